"""Every specx method with the target at tensor_parallel_size = 2, in the real vLLM CPU
engine (two worker processes, gloo), against the target at TP = 1 without speculation.

One engine per method (a TP engine starts two worker processes: 45-130 s on a busy 2-core
host), each
running one batch of ragged prompts whose KV does not fit at once (the scheduler
preempts). Greedy output must equal the TP = 1 no-speculation output token for token,
every TP rank must have built the specx drafter and drafted the same rounds, and vLLM's
spec-decode counters must show drafts accepted.

``mtad`` runs with the draft at vLLM's default draft TP (the target's, 2) and ``adaptive``
with ``draft_tensor_parallel_size: 2`` given; ``draft_tensor_parallel_size: 1`` is refused
before start (tests/parallel/test_parallel_config.py). The README's test command runs all
three: ``adaptive`` and ``specx_mtp`` (the MTP fixture, MLA split across the two ranks)
together cost about 80 s on a quiet 2-core host.

``make_llm`` sets ``VLLM_CPU_OMP_THREADS_BIND=nobind``: without it vLLM's CPU worker
stops at start ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
from engine_requests import counter, generate, greedy, output_ids, run_counting_preemptions

pytestmark = pytest.mark.engine

NEW_TOKENS = 32
PAIR, MTP = "pair", "mtp"
# 1.5 MiB per rank gives the pair's TP=2 engine 384 KV tokens (12 blocks; vLLM's log):
# most of the ragged prompts are admitted at once, their 32 new tokens each then need
# about 250 more and the scheduler preempts; the longest request (200 + 32) fits alone.
# The MTP fixture's MLA cache (576 floats per token in 3 + 1 layers: 9 KiB): 3 MiB,
# about 340 tokens, for prompts of 241 tokens plus 8 x 32 new ones.
ENGINE_KW: dict[str, dict[str, Any]] = {
    PAIR: dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512,
               kv_cache_memory_bytes=3 * 2**19, skip_tokenizer_init=True,
               disable_log_stats=False),
    MTP: dict(max_model_len=256, max_num_seqs=16, kv_cache_memory_bytes=3 * 2**20,
              skip_tokenizer_init=True, disable_log_stats=False),
}
DRAFT = "<fixture draft>"
METHODS = [
    pytest.param((PAIR, {"method": "mtad", "model": DRAFT, "num_speculative_tokens": 3,
                         "num_beams": 2}), id="mtad-draft_tp_default"),
    pytest.param((PAIR, {"method": "adaptive", "model": DRAFT, "num_speculative_tokens": 6,
                         "confidence_threshold": 0.4, "draft_tensor_parallel_size": 2}),
                 id="adaptive-draft_tp_2"),
    pytest.param((MTP, {"method": "specx_mtp", "num_speculative_tokens": 4, "adaptive": True}),
                 id="specx_mtp"),
]


def _target(name: str) -> str:
    from vllm_specx.fixtures import fixture_model_dirs, fixtures_root

    return str(fixture_model_dirs()[0] if name == PAIR else fixtures_root() / "mtp_target")


def _ragged_prompts(name: str) -> list[list[int]]:
    """Ragged prompts of 3 to 200 tokens (ids in the fixtures' shared low range)."""
    vocab = 500
    lengths = ([3, 200, 17, 40, 9, 40, 33, 40, 25, 40] if name == PAIR
               else [3, 40, 17, 64, 9, 25, 50, 33])
    return [[4 + (7 * i + 13 * j) % vocab for j in range(n)] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def reference() -> Any:
    """``reference(target)``: greedy output at TP = 1 without speculation, once per target."""
    from vllm_specx.engine import running_llm

    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            with running_llm(_target(name), **ENGINE_KW[name]) as llm:
                cache[name] = output_ids(generate(llm, _ragged_prompts(name), greedy(NEW_TOKENS)))
        return cache[name]

    return get


def _rank_report(worker: Any) -> dict[str, Any]:
    """Runs in each TP worker process (collective_rpc): the drafter it built and its rounds."""
    drafter = worker.model_runner.drafter
    return {"drafter": type(drafter).__name__, "stats": drafter.specx_stats()}


@dataclass
class TpRun:
    target: str
    spec: dict[str, Any]
    outputs: list[list[int]]
    preemptions: int
    ranks: list[dict[str, Any]]
    drafts: float
    accepted: float
    tp_size: int


@pytest.fixture(scope="module", params=METHODS)
def tp_run(request) -> TpRun:
    from vllm_specx.engine import running_llm
    from vllm_specx.fixtures import fixture_model_dirs

    name, entry = request.param
    spec = {k: (str(fixture_model_dirs()[1]) if v == DRAFT else v) for k, v in entry.items()}
    started = time.monotonic()
    with running_llm(_target(name), tensor_parallel_size=2, speculative_config=spec,
                     **ENGINE_KW[name]) as llm:
        up = time.monotonic() - started
        prompts = _ragged_prompts(name)
        outs, preemptions = run_counting_preemptions(
            llm, lambda: generate(llm, prompts, greedy(NEW_TOKENS)))
        ranks = llm.collective_rpc(_rank_report)
        run = TpRun(name, spec, output_ids(outs), preemptions, ranks,
                    counter(llm, "vllm:spec_decode_num_drafts"),
                    counter(llm, "vllm:spec_decode_num_accepted_tokens"),
                    llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)
    print(f"[tp2] {spec['method']}: start {up:.1f} s, total {time.monotonic() - started:.1f} s, "
          f"{preemptions} preemptions, ranks {ranks}")
    return run


def test_greedy_at_tp2_equals_tp1_without_speculation(tp_run, reference):
    assert tp_run.tp_size == 2
    assert tp_run.outputs == reference(tp_run.target)
    assert all(len(o) == NEW_TOKENS for o in tp_run.outputs)


def test_every_tp_rank_built_the_specx_drafter_and_drafted_the_same_rounds(tp_run):
    expected = {"mtad": "MTADProposer", "adaptive": "AdaptiveProposer",
                "specx_mtp": "MtpProposer"}[tp_run.spec["method"]]
    assert [r["drafter"] for r in tp_run.ranks] == [expected, expected]
    stats = [r["stats"] for r in tp_run.ranks]
    # Every rank drafted the same rounds and tokens (the ranks' drafts are never compared
    # by vLLM: only rank 0's reach the scheduler).
    assert stats[0]["rounds"] > 0 and stats[0] == stats[1]


def test_drafts_were_accepted(tp_run):
    assert tp_run.drafts > 0 and tp_run.accepted > 0


def test_the_kv_cache_was_small_enough_to_preempt(tp_run):
    assert tp_run.preemptions > 0
