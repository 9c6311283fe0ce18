"""`specx_mtp` under chunked prefill and prefix caching: the MTP fixture as plain attention.

vLLM turns chunked prefill and prefix caching off for MLA models on its CPU platform, so
``test_mtp_engine.py`` (MLA) cannot reach them. Here the same checkpoint runs with
``VLLM_MLA_DISABLE=1`` (DeepSeek attention without the latent cache, vLLM's ``CPU_ATTN``
backend), where both are on: a prompt longer than the token budget is prefilled in
chunks (the MTP layer drafts from chunked hidden states), and a repeated batch hits the
prefix cache (the MTP layer's KV is cached with the target's). Greedy output must equal
no speculation, with the adaptive stop on. The stop here is an acceptance head on the MTP
layer's hidden state (a seeded untrained one: exactness cannot depend on the head's
quality); ``test_mtp_engine.py`` covers the training-free confidence stop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from engine_requests import counter, generate, greedy, output_ids

pytestmark = pytest.mark.engine

K = 4
NEW_TOKENS = 24
ENGINE_KW: dict[str, Any] = dict(
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,  # the 150-token prompt is prefilled in 3 chunks
    enable_prefix_caching=True,
    kv_cache_memory_bytes=8 * 2**20,
    skip_tokenizer_init=True,
    disable_log_stats=False,
)
SPEC = {"method": "specx_mtp", "num_speculative_tokens": K, "adaptive": True,
        "stop_threshold": 0.5, "cost_control": False}  # drafts must happen: no timing


@pytest.fixture(scope="module")
def mla_disabled() -> Iterator[None]:
    old = os.environ.get("VLLM_MLA_DISABLE")
    os.environ["VLLM_MLA_DISABLE"] = "1"
    yield
    if old is None:
        os.environ.pop("VLLM_MLA_DISABLE", None)
    else:
        os.environ["VLLM_MLA_DISABLE"] = old


@pytest.fixture(scope="module")
def runs(mla_disabled: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import json

    import torch
    from transformers import AutoTokenizer

    from vllm_specx.algorithms.acceptance_head import AcceptanceHead, save_head
    from vllm_specx.engine import make_llm, running_llm, shutdown_llm
    from vllm_specx.fixtures import fixtures_root, heldout_prompts

    target = str(fixtures_root() / "mtp_target")
    hidden = json.loads((fixtures_root() / "mtp_target" / "config.json").read_text())[
        "hidden_size"]
    torch.manual_seed(0)
    head = save_head(AcceptanceHead(hidden, num_blocks=1), tmp_path_factory.mktemp("head"))
    tok = AutoTokenizer.from_pretrained(target)
    texts = heldout_prompts(6)
    long = tok("\n".join(texts[:4]))["input_ids"][:150]
    prompts = [long, *(tok(t)["input_ids"][:40] for t in texts[4:6])]
    out: dict[str, Any] = {}
    with running_llm(target, **ENGINE_KW) as llm:
        out["plain"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
    llm = make_llm(target, speculative_config={**SPEC, "acceptance_head": str(head)},
                   **ENGINE_KW)
    try:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        out["use_mla"] = config.model_config.use_mla
        out["chunked"] = config.scheduler_config.enable_chunked_prefill
        out["drafter"] = type(runner.drafter).__name__
        out["stop_rule"] = type(runner.drafter.stop_rule(K)).__name__
        out["spec"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        hits = counter(llm, "vllm:prefix_cache_hits")
        accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
        out["again"] = output_ids(generate(llm, prompts, greedy(NEW_TOKENS)))
        out["prefix_hits"] = counter(llm, "vllm:prefix_cache_hits") - hits
        out["accepted_again"] = counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted
    finally:
        shutdown_llm(llm)
    return out


def test_plain_attention_with_chunked_prefill_and_prefix_caching_is_exact(runs):
    assert runs["use_mla"] is False and runs["chunked"] is True
    assert runs["drafter"] == "MtpProposer"
    assert runs["stop_rule"] == "HeadStop"  # the head was loaded and decides the stops
    assert runs["spec"] == runs["plain"]
    assert runs["again"] == runs["plain"]
    assert runs["prefix_hits"] > 0
    assert runs["accepted_again"] > 0  # drafts kept being accepted after cache hits
