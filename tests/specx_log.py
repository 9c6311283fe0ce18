"""The plugin's log lines (logger ``vllm.specx``), captured while a block runs: the one
line a config announces before start (runner, attention backend, eager) is what several
tests read."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def specx_log_lines() -> Iterator[list[str]]:
    """Yield the list that every ``vllm.specx`` message logged inside the block joins
    (INFO and above, whatever the logger's level was; restored afterwards)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("vllm.specx")
    keep, level = Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
