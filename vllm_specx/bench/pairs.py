"""The two model pairs the benchmark scripts run (``benchmarks/*.py``), resolved once.

``vllm-specx bench`` resolves its pair through its own options (``bench/cli.py``); the
standalone scripts in ``benchmarks/`` that build engines by hand (``zero_draft_step.py``,
``mtad_cost_control.py``) take the same two pairs from here instead of repeating the
lookup.
"""

from __future__ import annotations

from typing import Any


def pair_inputs(pair: str, num_prompts: int) -> tuple[str, str, list[str], dict[str, Any]]:
    """``(target, draft, prompts, engine_overrides)`` for ``pair`` (``"real"``: SmolLM2
    and the shipped drafter with the real held-out prompts; otherwise the tests' fixture
    pair and its held-out prompts), the prompt set repeated to ``num_prompts`` prompts.
    The real pair gets a 256 MiB KV cache (its longer prompts at batch 8 and more)."""
    overrides: dict[str, Any] = {}
    if pair == "real":
        from vllm_specx import real_pair
        from vllm_specx.bench.prompts import read_jsonl

        target = str(real_pair.ensure_target())
        draft = str(real_pair.draft_dir())
        pool = read_jsonl(real_pair.HELDOUT_PROMPTS).prompts
        overrides["kv_cache_memory_bytes"] = 256 << 20
    else:
        from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts

        target_p, draft_p = fixture_model_dirs()
        target, draft = str(target_p), str(draft_p)
        pool = heldout_prompts(max(num_prompts, 4))
    prompts = (pool * (num_prompts // len(pool) + 1))[:num_prompts]
    return target, draft, prompts, overrides
