"""Models, prompts and engine settings shared by the V2 tests (``from v2_cases import ...``)."""

from __future__ import annotations

from typing import Any

from vllm_specx.fixtures import fixtures_root

TARGET = str(fixtures_root() / "target")
DRAFT = str(fixtures_root() / "draft")
MTP_TARGET = str(fixtures_root() / "mtp_target")
ACCEPTANCE_HEAD = str(fixtures_root() / "head")

ENGINE_KWARGS: dict[str, Any] = {
    "max_num_batched_tokens": 64,
    "enable_prefix_caching": True,
    "disable_log_stats": False,  # spec-decode counters
}

# Ragged prompt lengths (one past the 64-token chunk: chunked prefill), short outputs.
PROMPTS: list[list[int]] = [
    [(7 * i + 3) % 500 + 10 for i in range(n)] for n in (5, 17, 70)
]
MAX_TOKENS = 12
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
