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


def build_eagle3_head(out_dir: str) -> str:
    """The test EAGLE-3 head (``scripts/build_eagle3_fixture.py``, as tests/eagle builds
    it), with its auxiliary layer ids also at the config's top level: vLLM 0.32's V2
    runner reads ``eagle_aux_hidden_state_layer_ids`` only there (V1 reads
    ``eagle_config`` too), and with the ids only in ``eagle_config`` V2 falls back to the
    model's defaults, (2, 2, 1) for this 4-layer target: two auxiliary states for an ``fc``
    over three, which fails in the engine (vLLM's own ``eagle3`` alike)."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "build_eagle3_fixture.py"
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", script)
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    path = Path(builder.build(Path(out_dir)))
    config = json.loads((path / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = config["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)
