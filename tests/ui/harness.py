"""What the dashboard tests share: Debian's Chromium (never a downloaded browser) and pages
opened in it, a live server whose app a test can reach, signing in, and scripted plans and
stragglers. The fixtures that build these live in ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from server.app import create_app
from tests.harness import ADMIN_TOKEN, make_settings, serving

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def launch_chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


@dataclass
class Page:
    """A Playwright page plus the JavaScript errors it logged."""

    page: Any
    errors: list[str]


def open_page(browser: Any, *, bypass_csp: bool) -> tuple[Any, Page]:
    """A fresh context and page that records JavaScript errors. Playwright's polling
    (``wait_for_function``) evaluates strings, which the pages' CSP forbids, so most tests
    bypass the CSP; ``test_job_page_runs_under_its_content_security_policy`` does not."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000}, bypass_csp=bypass_csp)
    context.set_default_timeout(10_000)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))

    def on_console(msg: Any) -> None:
        # Resource errors (a 404 for an optional endpoint, a 401 when signed out) are the
        # browser's, not the page's; anything else logged as an error fails the test.
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            errors.append(f"console: {msg.text}")

    pg.on("console", on_console)
    return context, Page(pg, errors)


@dataclass
class LiveApp:
    url: str
    admin_token: str
    app: FastAPI


@contextmanager
def serve(db_path: Path) -> Iterator[LiveApp]:
    """A real uvicorn server on a free port, in a thread, with its app at hand."""
    app = create_app(make_settings(f"sqlite:///{db_path}"))
    with serving(app) as url:
        yield LiveApp(url, ADMIN_TOKEN, app)


def sign_in(page: Any, url: str, token: str, path: str = "/jobs") -> None:
    # Both navigations wait for DOMContentLoaded (the form and the page's module scripts are
    # there by then; each test waits for the elements it needs), with more time than a single
    # element gets: waiting for the whole load (the stylesheet, the icon, Plotly) within 10 s
    # failed in CI on a loaded 2-core machine, once landing on the path and once opening the
    # login page itself, beside a job's emulated workers in the same process.
    page.goto(f"{url}/login?next={path}", wait_until="domcontentloaded", timeout=30_000)
    page.fill("input[name=token]", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}{path}", wait_until="domcontentloaded", timeout=30_000)


def wait_until_live(page: Any) -> None:
    """Wait for the job page's live stream to open. Its first load draws Plotly, reads six API
    resources and draws the history before it opens the stream: on a loaded 2-core CI machine
    that once took more than the 10 s an element gets (the stream itself was fine)."""
    page.wait_for_function(
        "document.querySelector('#live-state')?.dataset.state === 'live'", timeout=30_000
    )


# ----------------------------------------------------------------- what a rebalancer would do

PER_SAMPLE_MS = [0.12, 0.2, 0.3, 0.45]
INTERCEPT_MS = 4.0


def minmax_batches(per_sample_ms: list[float], global_batch: int) -> list[int]:
    """The min-max plan for linear workers: each next sample to the worker finishing first."""
    batches = [0] * len(per_sample_ms)
    for _ in range(global_batch):
        r = min(range(len(batches)), key=lambda i: per_sample_ms[i] * (batches[i] + 1))
        batches[r] += 1
    return batches


def issue_plan(live: LiveApp, job_id: int, batches: list[int], predicted_ms: float) -> int:
    """Store an automatic plan with a prediction, as the rebalancer (built on main) will."""
    from contract.enums import PlanSource
    from server.db import transaction
    from server.services import jobs, plans

    with live.app.state.context.write_lock, transaction(live.app.state.context.sessions) as s:
        plan = plans.create(
            s,
            jobs.get(s, job_id),
            batches,
            PlanSource.AUTOMATIC,
            "minmax from fitted models: every worker finishes together",
            by="rebalancer",
            predicted_ms=predicted_ms,
        )
        return plan.version


def record_straggler(live: LiveApp, job_id: int, rank: int, iteration: int) -> None:
    """Store a straggler event, as the detector (built on another branch) will."""
    from server.db import transaction
    from server.models import StragglerEvent

    with live.app.state.context.write_lock, transaction(live.app.state.context.sessions) as s:
        s.add(
            StragglerEvent(
                job_id=job_id,
                rank=rank,
                kind="slowdown",
                severity=1.8,
                start_iteration=iteration,
                action="rebalance",
                detail={"compute_ms_ratio": 1.8},
            )
        )
