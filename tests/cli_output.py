"""What a CLI wrote to stderr, without other loggers' noise.

A test process that already ran an engine has vLLM's CPU worker wrapper around
``torch.set_num_threads``, which logs a warning through vLLM's logger; that logger's handler
may hold the stream of an earlier test's capture, now closed, and Python's logging then
prints a "--- Logging error ---" report (traceback, call stack, message) to the current
stderr. A real CLI process has neither, so the one-line refusals are checked without it.
"""

from __future__ import annotations


def without_logging_errors(err: str) -> list[str]:
    """The lines of ``err`` outside Python's "--- Logging error ---" reports."""
    lines: list[str] = []
    in_report = False
    for line in err.strip().splitlines():
        if line.startswith("--- Logging error ---"):
            in_report = True
        elif in_report and line.startswith("Arguments: "):
            in_report = False  # the report's last line
        elif not in_report:
            lines.append(line)
    return lines
