"""Fixtures for the dashboard tests: Debian's Chromium driven by Playwright (never a
downloaded browser), a live server whose app the test can reach, and a simulated cluster.

Without /usr/bin/chromium the browser tests skip with the reason, except under CI=true.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import IN_CI
from tests.ui.harness import (
    CHROMIUM,
    LiveApp,
    Page,
    launch_chromium,
    open_page,
    serve,
)
from tests.ui.simulated import Cluster


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not os.path.exists(CHROMIUM):
        reason = f"{CHROMIUM} is missing (make browser-deps installs Debian's chromium)"
        if IN_CI:
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch_chromium(p)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, live_app: LiveApp) -> Iterator[Page]:
    """A page closed before its server stops (an open live stream would hold the shutdown)."""
    context, pg = open_page(browser, bypass_csp=True)
    yield pg
    context.close()
    assert not pg.errors, pg.errors


@pytest.fixture
def live_app(tmp_path: Path) -> Iterator[LiveApp]:
    """Like ``live_server``, but the test can also reach the app (its database sessions)."""
    with serve(tmp_path / "live.db") as live:
        yield live


@pytest.fixture
def cluster(live_app: LiveApp) -> Iterator[Cluster]:
    c = Cluster(live_app.url, live_app.admin_token)
    yield c
    c.close()
