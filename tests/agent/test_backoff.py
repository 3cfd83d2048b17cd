"""The one retry policy: bounded, growing, and back to nothing after a success."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.backoff import Backoff


@given(
    initial=st.floats(0.001, 10.0),
    ceiling=st.floats(0.001, 100.0),
    factor=st.floats(1.0, 4.0),
    outcomes=st.lists(st.booleans(), max_size=60),
)
def test_delays_grow_within_bounds_and_reset_on_success(
    initial: float, ceiling: float, factor: float, outcomes: list[bool]
) -> None:
    if ceiling < initial:
        initial, ceiling = ceiling, initial
    b = Backoff(initial, ceiling, factor)
    previous = 0.0
    for ok in outcomes:
        if ok:
            b.succeeded()
            assert not b.failing and b.current_s == 0.0
            previous = 0.0
            continue
        delay = b.failed()
        assert initial <= delay <= ceiling
        assert delay >= previous  # never shorter while failures go on
        assert delay == pytest.approx(min(ceiling, max(initial, previous * factor)))
        previous = delay


def test_first_delays_double_up_to_the_ceiling() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize("args", [(0.0, 1.0), (2.0, 1.0), (1.0, 2.0, 0.5)])
def test_nonsense_is_refused(args: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="invalid backoff"):
        Backoff(*args)
