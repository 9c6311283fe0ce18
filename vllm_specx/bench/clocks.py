"""Process CPU seconds inside the callables a benchmark wraps (the target's ``forward``, a
drafter's ``propose``, a sampler, an engine step's parts): one clock, one wrapper, for
``benchmarks/interleaved_speedup.py``, ``zero_draft_step.py`` and ``round_parity.py``::

    clock = CpuClock()
    model.forward = clock.wrap(model.forward)
    ...
    clock.seconds  # CPU seconds spent inside every call so far

Process CPU time, not wall time: on a shared host it does not count the time the process
waits for a core, so two rows measured minutes apart stay comparable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class CpuClock:
    """Sums the process CPU seconds spent inside the callables it wraps."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed on this clock (a call that raises is counted too)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t0

        return timed
