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


def heldout_prompts() -> list[list[int]]:
    """Four held-out code prompts (token ids, ragged lengths) on which the test EAGLE-3
    head's drafts are accepted (on PROMPTS none are): the head-tree tests' requests."""
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts as texts

    tok = AutoTokenizer.from_pretrained(TARGET)
    enc = [tok(t)["input_ids"] for t in texts(4)]
    return [enc[0][:5], enc[1][:33], enc[2][:48], enc[3][:17]]


def build_eagle3_head(out_dir: str) -> str:
    """The test EAGLE-3 head (``scripts/build_eagle3_fixture.py``, as tests/eagle builds
    it). Its auxiliary layer ids are in ``eagle_config`` only, which vLLM 0.32's V2 runner
    does not read (V1 does): for specx_eagle3 the plugin hands them to the target after
    ``load_model`` (``glue/v2_sampler.align_eagle3_aux_layers``); without that V2 would
    use this 4-layer target's defaults, (2, 2, 1): two auxiliary states for an ``fc``
    over three, which fails in the engine."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "build_eagle3_fixture.py"
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", script)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return str(builder.build(Path(out_dir)))
