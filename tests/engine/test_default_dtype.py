"""The engines' default dtype (``vllm_specx.engine.default_dtype``) in the real engine.

The rest of the suite pins float32 (tests/conftest.py sets ``VLLM_SPECX_CPU_DTYPE``, the
dtype of its transformers references); here the variable is removed so engines start
with the default a user gets -- bfloat16 on a CPU with native bfloat16, with the
``cpu_onednn_packed_linear`` layers -- and every speculative method's greedy output must
equal no speculation in that dtype, on the fixture pair (short outputs: one engine per
method, in this process, shut down in turn).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_requests import generate, greedy, output_ids
from vllm_specx.engine import DTYPE_ENV, cpu_has_native_bf16, default_dtype

pytestmark = pytest.mark.engine

NEW_TOKENS = 20
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=8 * 2**20,
    skip_tokenizer_init=True,
)
# (target fixture, speculative config without the draft model's path)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "ngram": ("target", {"method": "ngram", "num_speculative_tokens": 3,
                         "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    "draft_model": ("target", {"method": "draft_model", "num_speculative_tokens": 3}),
    "mtad": ("target", {"method": "mtad", "num_speculative_tokens": 3, "num_beams": 2}),
    "adaptive": ("target", {"method": "adaptive", "num_speculative_tokens": 4}),
    "specx_mtp": ("mtp_target", {"method": "specx_mtp", "num_speculative_tokens": 2}),
}


def _prompts() -> list[list[int]]:
    # Ragged lengths, token ids of the fixture tokenizer's range; a repeated phrase gives
    # ngram something to match.
    return [[5, 17, 99, 4, 5, 17, 99], list(range(40, 80)), [300, 301, 302] * 6]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm_specx.engine import make_llm, running_llm, shutdown_llm
    from vllm_specx.fixtures import fixture_model_dirs, fixtures_root

    target, draft = (str(p) for p in fixture_model_dirs())
    paths = {"target": target, "mtp_target": str(fixtures_root() / "mtp_target")}
    out: dict[str, Any] = {"plain": {}, "spec": {}}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(DTYPE_ENV, raising=False)
        out["default"] = default_dtype()
        for name, path in paths.items():
            with running_llm(path, **ENGINE_KW) as llm:
                if name == "target":
                    out["dtype"] = str(llm.llm_engine.model_config.dtype)
                    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
                    out["linear"] = _qkv_linear_name(runner.model)
                out["plain"][name] = output_ids(
                    generate(llm, _prompts(), greedy(NEW_TOKENS)))
        for method, (which, spec) in METHODS.items():
            spec = dict(spec)
            if method in ("draft_model", "mtad", "adaptive"):
                spec["model"] = draft
            llm = make_llm(paths[which], speculative_config=spec, **ENGINE_KW)
            try:
                out["spec"][method] = (which, output_ids(
                    generate(llm, _prompts(), greedy(NEW_TOKENS))))
            finally:
                shutdown_llm(llm)
    return out


def _qkv_linear_name(model: Any) -> str:
    layer = model.model.layers[0].self_attn.qkv_proj
    return getattr(layer, "cpu_linear", lambda: None).__qualname__


def test_the_default_dtype_reaches_the_engine(runs):
    # bfloat16 exactly where the CPU has native bfloat16 arithmetic.
    assert runs["default"] == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert runs["dtype"] == f"torch.{runs['default']}"
    # The engine's linear layers are the oneDNN prepacked ones.
    assert "packed_linear" in runs["linear"]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_no_speculation_in_the_default_dtype(runs, method):
    which, ids = runs["spec"][method]
    assert [len(r) for r in ids] == [NEW_TOKENS] * len(_prompts())
    assert ids == runs["plain"][which]
