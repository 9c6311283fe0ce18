"""The CPU clock the benchmark scripts wrap callables with (vllm_specx/bench/clocks.py)."""

from __future__ import annotations

import time

import pytest

from vllm_specx.bench.clocks import CpuClock


def _burn(seconds: float) -> int:
    """Busy for ``seconds`` of process CPU time; returns how many loops that took."""
    t0, loops = time.process_time(), 0
    while time.process_time() - t0 < seconds:
        loops += 1
    return loops


def test_the_clock_sums_cpu_inside_wrapped_calls_only():
    clock = CpuClock()
    timed = clock.wrap(_burn)
    assert timed(0.02) > 0  # the callable's result comes back
    inside = clock.seconds
    assert inside >= 0.02
    _burn(0.05)  # outside any wrapped call: not counted
    assert clock.seconds == inside
    timed(0.02)
    assert clock.seconds >= inside + 0.02


def test_a_call_that_raises_is_counted_and_the_error_propagates():
    clock = CpuClock()

    def fails() -> None:
        _burn(0.02)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        clock.wrap(fails)()
    assert clock.seconds >= 0.02
