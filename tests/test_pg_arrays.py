"""``server.scale.pg_arrays``: numpy-packed binary arrays are exactly what psycopg would send, and
PostgreSQL reads them back as the values given."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.adapt import PyFormat, Transformer

from server.scale.pg_arrays import Kind, packed
from tests.harness import IN_CI, PG_ADMIN_URL

pytestmark = pytest.mark.postgres

BOUNDS: dict[str, tuple[int, int]] = {
    "integer": (-(2**31), 2**31 - 1),
    "bigint": (-(2**63), 2**63 - 1),
}


def _values(kind: Kind) -> st.SearchStrategy[list[Any]]:
    if kind == "float8":
        one: st.SearchStrategy[Any] = st.floats(allow_nan=False)
    elif kind == "boolean":
        one = st.booleans()
    else:
        one = st.integers(*BOUNDS[kind])
    return st.lists(st.one_of(st.none(), one) | one, min_size=1, max_size=40)


kinds = st.sampled_from(["integer", "bigint", "float8", "boolean"])


@pytest.fixture(scope="module")
def conn() -> Iterator[psycopg.Connection[Any]]:
    url = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    try:
        connection = psycopg.connect(url, connect_timeout=3, autocommit=True)
    except psycopg.OperationalError as exc:
        if IN_CI:
            pytest.fail(f"CI=true but PostgreSQL at {url} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {url} is unreachable: {exc}")
    with connection:
        yield connection


@settings(max_examples=150, deadline=None)
@given(data=st.data(), kind=kinds)
def test_packed_arrays_read_back_as_the_values(
    conn: psycopg.Connection[Any], data: st.DataObject, kind: Kind
) -> None:
    values = data.draw(_values(kind))
    row = conn.execute(f"SELECT %b::{kind}[]", [packed(values, kind)]).fetchone()
    assert row is not None
    assert row[0] == values


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=40))
def test_a_float_column_is_the_bytes_psycopg_would_send(
    conn: psycopg.Connection[Any], values: list[float]
) -> None:
    theirs = Transformer(conn).get_dumper(values, PyFormat.BINARY).dump(values)
    assert bytes(packed(values, "float8").data) == bytes(theirs)


def test_a_column_of_nulls_and_a_nan_read_back(conn: psycopg.Connection[Any]) -> None:
    row = conn.execute(
        "SELECT %b::float8[], %b::integer[]",
        [packed([None, None], "float8"), packed([None], "integer")],
    ).fetchone()
    assert row == ([None, None], [None])
    (nan,) = conn.execute("SELECT %b::float8[]", [packed([math.nan], "float8")]).fetchone() or ()
    assert math.isnan(nan[0])


@pytest.mark.parametrize("values", [[2**31], [1, -(2**31) - 1], [2**31, None]])
def test_an_integer_out_of_range_is_refused_not_wrapped(values: list[int | None]) -> None:
    with pytest.raises(OverflowError):
        packed(values, "integer")
    with pytest.raises(OverflowError):
        packed([2**63], "bigint")
