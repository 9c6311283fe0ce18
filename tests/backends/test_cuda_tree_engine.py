"""Draft trees in vLLM's CUDA engine (V1 runner, issue 34): greedy output equals no
speculation token for token. **Runs only with a GPU; skipped in CI and on CPU hosts.**

Three in-process engines on the fixture target, one after another (float32, eager, the
suite's small KV cache): no speculation (the reference, on vLLM's ``TRITON_ATTN`` backend
like the tree engines, so both sides run the same attention kernels outside tree steps),
``adaptive`` with a draft-model tree (the fixture draft) and ``specx_eagle3`` with a
dynamic head tree (the seeded test EAGLE-3 head of ``scripts/build_eagle3_fixture.py``).
The tree engines are given no attention backend and no runner: the plugin must switch
them to ``TRITON_ATTN`` and vLLM must pick its V1 runner (the V2 opt-out list). One
batch per engine mixes a chunked 70-token prefill with decodes and requests that end 2
and 5 tokens in, i.e. inside a tree; a second batch has a request with a repetition
penalty, which makes its steps verify the drafts as a chain (``chain_fallback_steps``).
Every tree step's attention must have gone through the Triton tree kernel
(``cuda_tree_attention.tree_forward``, counted) and some accepted paths must have been
compacted (``copy_slots`` on CUDA).

On the GPU machine (see the report of the cuda-tree-route helper / docs/trees.md):
``bash .gpu-stage/bin/run_tests.sh tests/backends -x -q``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (draft trees in vLLM's CUDA engine)"),
]

ENGINE_KW: dict[str, Any] = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,  # the 70-token prompt is prefilled in two chunks
    skip_tokenizer_init=True,
)
DRAFT_TREE = {"max_nodes": 8, "max_depth": 3, "branching": 3}
HEAD_TREE = {"max_nodes": 8, "max_depth": 4, "branching": 2}
MAX_TOKENS = [24, 2, 24, 5, 16]


def _prompts(target: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts

    tok = AutoTokenizer.from_pretrained(target)
    texts = heldout_prompts(8)
    enc = [tok(t)["input_ids"] for t in texts]
    long = tok("\n".join(texts[:3]))["input_ids"][:70]
    return [enc[0][:9], enc[1][:20], long, enc[2][:14], enc[3][:30]]


def _run(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(params: list[Any]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids)
                for o in sorted(outs, key=lambda o: int(o.request_id))]

    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]
    penalised = [SamplingParams(temperature=0.0, max_tokens=n,
                                repetition_penalty=1.3 if i == 0 else 1.0)
                 for i, n in enumerate(MAX_TOKENS)]
    return {"greedy": generate(greedy), "penalised": generate(penalised)}


def _describe(llm: Any) -> dict[str, Any]:
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    config = llm.llm_engine.vllm_config
    state = getattr(runner, "specx_tree_state", None)
    return {
        "runner_module": type(runner).__module__,
        "attention_backend": getattr(config.attention_config.backend, "name", None),
        "enforce_eager": config.model_config.enforce_eager,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "drafter": type(getattr(runner, "drafter", None)).__name__,
        "stats": dataclasses.replace(state.stats) if state is not None else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import importlib.util
    from pathlib import Path

    from vllm_specx.engine import running_llm
    from vllm_specx.fixtures import fixtures_root
    from vllm_specx.glue import cuda_tree_attention

    target = str(fixtures_root() / "target")
    draft = str(fixtures_root() / "draft")
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_eagle3_fixture.py"
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", script)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    head = str(builder.build(tmp_path_factory.mktemp("eagle3_head"), target=Path(target)))
    prompts = _prompts(target)

    # Every call of the tree kernel from the patched TritonAttentionImpl.forward.
    calls = {"n": 0}
    original = cuda_tree_attention.tree_forward

    def counted(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        return original(*args, **kw)

    cuda_tree_attention.tree_forward = counted
    out: dict[str, Any] = {}
    try:
        with running_llm(target, attention_backend="TRITON_ATTN", **ENGINE_KW) as llm:
            out["plain"] = _run(llm, prompts)
        configs = {
            "adaptive": {"method": "adaptive", "model": draft, "num_speculative_tokens": 4,
                         "draft_tree": DRAFT_TREE},
            "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": 4,
                       "draft_tree": HEAD_TREE},
        }
        for name, spec_config in configs.items():
            before = calls["n"]
            with running_llm(target, speculative_config=spec_config, **ENGINE_KW) as llm:
                out[name] = _run(llm, prompts)
                out[name + "_engine"] = _describe(llm)
            out[name + "_kernel_calls"] = calls["n"] - before
    finally:
        cuda_tree_attention.tree_forward = original
    return out


@pytest.mark.parametrize("name", ["adaptive", "eagle3"])
def test_trees_run_on_v1_with_triton_attention_eager(runs, name) -> None:
    engine = runs[name + "_engine"]
    assert engine["runner_module"] == "vllm.v1.worker.gpu_model_runner", engine
    assert engine["attention_backend"] == "TRITON_ATTN", engine
    assert engine["enforce_eager"] and "NONE" in engine["cudagraph_mode"], engine
    assert engine["stats"] is not None


@pytest.mark.parametrize("name", ["adaptive", "eagle3"])
def test_greedy_tree_output_equals_no_speculation(runs, name) -> None:
    """Mixed batch (a chunked prefill, decodes, requests ending inside a tree), then the
    same with one penalised request (its steps verified as chains)."""
    for batch in ("greedy", "penalised"):
        got, want = runs[name][batch], runs["plain"][batch]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"{name} {batch} request {i}: {g} != {w}"
    assert [len(t) for t in runs[name]["greedy"]] == MAX_TOKENS


@pytest.mark.parametrize("name", ["adaptive", "eagle3"])
def test_tree_steps_went_through_the_tree_kernel(runs, name) -> None:
    stats = runs[name + "_engine"]["stats"]
    assert stats.tree_requests > 0 and stats.tree_nodes > stats.tree_requests, stats
    assert runs[name + "_kernel_calls"] > 0, "no layer ran cuda_tree_attention.tree_forward"
    assert stats.chain_fallback_steps > 0, stats  # the penalised batch
    if name == "adaptive":  # the trained draft: deep paths off the first BFS nodes
        assert stats.accepted > stats.tree_requests and stats.compacted > 0, stats
