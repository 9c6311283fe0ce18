"""Draft trees in vLLM's CUDA engine, V1 runner and Model Runner V2 (issue 34): greedy
output equals no speculation token for token. **Runs only with a GPU; skipped in CI and on
CPU hosts.**

Five in-process engines on the fixture target, one after another (float32, eager, the
suite's small KV cache): no speculation (the reference, on vLLM's ``TRITON_ATTN`` backend
like the tree engines, so both sides run the same attention kernels outside tree steps;
vLLM's default runner, V2 on CUDA), then ``adaptive`` with a draft-model tree (the fixture
draft) and ``specx_eagle3`` with a dynamic head tree (the seeded test EAGLE-3 head of
``scripts/build_eagle3_fixture.py``), each twice: on the V1 runner
(``VLLM_USE_V2_MODEL_RUNNER=0``) and on vLLM's default runner (the variable unset), which
must be Model Runner V2 (a tree config is no longer sent to V1 on CUDA). The tree engines
are given no attention backend: the plugin must switch them to ``TRITON_ATTN``, eager.
One batch per engine mixes a chunked 70-token prefill with decodes and requests that end 2
and 5 tokens in, i.e. inside a tree; a second batch has a request with a repetition
penalty, which makes its steps verify the drafts as a chain (``chain_fallback_steps``).
Every tree step's attention must have gone through the Triton tree kernel
(``cuda_tree_attention.tree_forward``, counted per engine) and some accepted paths must
have been compacted (the CUDA backend's ``copy_slots``).

The V1 and V2 engines are separate fixtures (the V2 ones one per method), so a failure on
one runner leaves the other's results standing. On the GPU machine (docs/trees.md):
``bash .gpu-stage/bin/run_tests.sh tests/backends/test_cuda_tree_engine.py -q``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from specx_log import specx_log_lines

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
        "drafter": type(getattr(runner, "drafter", None)).__name__,  # V1
        "speculator": type(getattr(runner, "speculator", None)).__name__,  # V2
        "stats": dataclasses.replace(state.stats) if state is not None else None,
    }


V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
CONFIGS = ("adaptive", "eagle3")
V2_SPECULATORS = {"adaptive": "DraftTreeV2Speculator", "eagle3": "EagleChainV2Speculator"}


@contextlib.contextmanager
def _runner_env(value: str | None) -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` set to ``value`` (None: unset, vLLM's default) while an
    engine is built; vLLM caches its environment while an engine runs, so the cache is
    cleared first (``shutdown_llm`` clears it after each engine too)."""
    from vllm import envs

    envs.disable_envs_cache()
    old = os.environ.get(V2_ENV)
    if value is None:
        os.environ.pop(V2_ENV, None)
    else:
        os.environ[V2_ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(V2_ENV, None)
        else:
            os.environ[V2_ENV] = old


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fixture target and draft, the test EAGLE-3 head, the prompts and the two tree
    configs (vLLM's ``eagle3`` with ``draft_tree`` is ``specx_eagle3``)."""
    import importlib.util
    from pathlib import Path

    from vllm_specx.fixtures import fixtures_root

    target = str(fixtures_root() / "target")
    draft = str(fixtures_root() / "draft")
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_eagle3_fixture.py"
    spec = importlib.util.spec_from_file_location("build_eagle3_fixture", script)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    head = str(builder.build(tmp_path_factory.mktemp("eagle3_head"), target=Path(target)))
    return {
        "target": target,
        "prompts": _prompts(target),
        "configs": {
            "adaptive": {"method": "adaptive", "model": draft, "num_speculative_tokens": 4,
                         "draft_tree": DRAFT_TREE, "cost_control": False},
            "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": 4,
                       "draft_tree": HEAD_TREE, "cost_control": False},
        },
    }


@pytest.fixture(scope="module")
def kernel_calls() -> Iterator[dict[str, int]]:
    """Every call of the tree kernel from the patched TritonAttentionImpl.forward."""
    from vllm_specx.glue import cuda_tree_attention

    calls = {"n": 0}
    original = cuda_tree_attention.tree_forward

    def counted(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        return original(*args, **kw)

    cuda_tree_attention.tree_forward = counted
    try:
        yield calls
    finally:
        cuda_tree_attention.tree_forward = original


@pytest.fixture(scope="module")
def plain(models: dict[str, Any]) -> dict[str, Any]:
    """No speculation on TRITON_ATTN, vLLM's default runner: the reference."""
    from vllm_specx.engine import running_llm

    with _runner_env(None), running_llm(models["target"], attention_backend="TRITON_ATTN",
                                        **ENGINE_KW) as llm:
        return {**_run(llm, models["prompts"]), "engine": _describe(llm)}


def _tree_engine(models: dict[str, Any], kernel_calls: dict[str, int], name: str,
                 runner_env: str | None) -> dict[str, Any]:
    from vllm_specx.engine import running_llm

    before = kernel_calls["n"]
    with _runner_env(runner_env), specx_log_lines() as lines, running_llm(
            models["target"], speculative_config=models["configs"][name], **ENGINE_KW) as llm:
        out = _run(llm, models["prompts"])
        out["engine"] = _describe(llm)
    out["kernel_calls"] = kernel_calls["n"] - before
    out["cuda_line"] = [line for line in lines if "with draft_tree on CUDA" in line]
    return out


@pytest.fixture(scope="module")
def runs(models: dict[str, Any], kernel_calls: dict[str, int],
         plain: dict[str, Any]) -> dict[str, Any]:
    """The V1 runner's tree engines (VLLM_USE_V2_MODEL_RUNNER=0), in the layout the V1
    tests read: ``runs[name]``, ``runs[name + "_engine"]``, ``runs[name + "_kernel_calls"]``."""
    out: dict[str, Any] = {"plain": plain}
    for name in CONFIGS:
        got = _tree_engine(models, kernel_calls, name, "0")
        out[name] = got
        out[name + "_engine"] = got["engine"]
        out[name + "_kernel_calls"] = got["kernel_calls"]
    return out


@pytest.fixture(scope="module", params=CONFIGS)
def v2_run(request: pytest.FixtureRequest, models: dict[str, Any],
           kernel_calls: dict[str, int]) -> dict[str, Any]:
    """One tree engine on vLLM's default runner (VLLM_USE_V2_MODEL_RUNNER unset)."""
    return {"name": request.param,
            **_tree_engine(models, kernel_calls, request.param, None)}


@pytest.mark.parametrize("name", ["adaptive", "eagle3"])
def test_trees_run_on_v1_with_triton_attention_eager(runs, name) -> None:
    engine = runs[name + "_engine"]
    assert engine["runner_module"] == V1_RUNNER, engine
    assert engine["attention_backend"] == "TRITON_ATTN", engine
    assert engine["enforce_eager"] and "NONE" in engine["cudagraph_mode"], engine
    assert engine["stats"] is not None
    lines = runs[name]["cuda_line"]  # once per config translation (once in-process)
    assert lines and all("on Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0)" in line
                         for line in lines), lines


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


# -- Model Runner V2 (vLLM's default runner on CUDA) -----------------------------------


def test_trees_run_on_v2_by_default_with_triton_attention_eager(v2_run) -> None:
    """No runner asked for: vLLM's default, which must be V2 (the reference engine, built
    the same way without speculation, too), with the V2 tree speculator, TRITON_ATTN, no
    CUDA graph, and the one line before start saying so."""
    engine, name = v2_run["engine"], v2_run["name"]
    assert engine["runner_module"] == V2_RUNNER, engine
    assert engine["speculator"] == V2_SPECULATORS[name], engine
    assert engine["attention_backend"] == "TRITON_ATTN", engine
    assert engine["enforce_eager"] and "NONE" in engine["cudagraph_mode"], engine
    assert engine["stats"] is not None
    lines = v2_run["cuda_line"]
    assert lines and all("on Model Runner V2 (vLLM's default" in line and "eager" in line
                         and "TRITON_ATTN" in line for line in lines), lines


def test_greedy_tree_output_equals_no_speculation_on_v2(v2_run, plain) -> None:
    """The V1 cases' batches on V2: the same tokens as no speculation."""
    name = v2_run["name"]
    for batch in ("greedy", "penalised"):
        for i, (g, w) in enumerate(zip(v2_run[batch], plain[batch], strict=True)):
            assert g == w, f"V2 {name} {batch} request {i}: {g} != {w}"
    assert [len(t) for t in v2_run["greedy"]] == MAX_TOKENS


def test_tree_steps_went_through_the_tree_kernel_on_v2(v2_run) -> None:
    stats, name = v2_run["engine"]["stats"], v2_run["name"]
    assert stats.tree_requests > 0 and stats.tree_nodes > stats.tree_requests, stats
    assert v2_run["kernel_calls"] > 0, "no layer ran cuda_tree_attention.tree_forward"
    assert stats.chain_fallback_steps > 0, stats  # the penalised batch
    if name == "adaptive":
        assert stats.accepted > stats.tree_requests and stats.compacted > 0, stats


def test_the_reference_ran_on_vllms_default_runner_v2(plain) -> None:
    """What the V2 cases compare with: no speculation on V2 (vLLM's default on CUDA)."""
    assert plain["engine"]["runner_module"] == V2_RUNNER, plain["engine"]
