"""MTAD with a draft whose tokenizer is not the target's (``use_heterogeneous_vocab``).

The drafts are rewrites of the committed fixture draft (``make_heterogeneous_vocab_draft``):
every token gets a new id, 16 draft-only tokens shadow the draft's favourite tokens (an
unconstrained draft would pick one at most positions), and in one of them 16 tokens the
prompts contain are missing from the draft. Four real engines run the same prompts:
no speculation, MTAD with the original draft, MTAD with each rewritten draft.

* Without missing tokens the rewritten draft restricted to the shared vocabulary is the
  original draft under other ids, so its drafts (in target ids) and q must equal the
  original's round for round, and so must vLLM's acceptance counters.
* With missing tokens the drafts must equal an HF reference beam search run on the
  translated context (ground-truth translation from the rewrite, not vLLM's mapping).
* Greedy output equals non-speculative output; seeded sampled requests reproduce.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_support import (
    DraftVocab,
    SharedVocabDraft,
    check_rounds_against_reference,
    start_engine,
)
from mtad_reference import Warping

pytestmark = pytest.mark.engine

K = 4
BEAMS = 2
PROMPT_LENS = (20, 45, 80, 33)  # the 80-token prompt is prefilled in chunks (64 budget)
GREEDY_TOKENS = 24
SAMPLED = Warping(temperature=1.0, top_k=20, top_p=0.9)
ENGINE_KW: dict[str, Any] = dict(max_model_len=160, disable_log_stats=False)
COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def _counters(llm: Any) -> dict[str, float]:
    return {
        name: sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)
        for name in COUNTERS
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts
    from vllm_specx.testing.tiny_models import make_heterogeneous_vocab_draft

    target, draft = (str(p) for p in fixture_model_dirs())
    tok = AutoTokenizer.from_pretrained(target)
    # Held-out code, cut into prompts of the lengths above (each starts with BOS).
    text_ids = tok("\n".join(heldout_prompts(8))).input_ids[1:]
    starts = [0, 20, 65, 145]
    prompts = [[tok.bos_token_id] + text_ids[s:s + n - 1] for s, n in zip(starts, PROMPT_LENS)]
    assert [len(p) for p in prompts] == list(PROMPT_LENS)
    root = tmp_path_factory.mktemp("hetero")
    renumbered = make_heterogeneous_vocab_draft(draft, root / "renumbered", seed=0)
    missing = make_heterogeneous_vocab_draft(
        draft, root / "missing", seed=1, drop_tokens=16,
        drop_from_text=tok.decode([t for p in prompts for t in p[1:]]),
    )
    return dict(target=target, draft=draft, tok=tok, prompts=prompts,
                renumbered=renumbered, missing=missing)


def _greedy_params():
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS) for _ in PROMPT_LENS]


def _sampled_params():
    from vllm import SamplingParams

    # Short prompts only: a seeded request in a chunked prefill hits vLLM's CPU
    # generator defect (docs/upstream-vllm-cpu-adapter-defects.md, item 4).
    return [
        SamplingParams(temperature=SAMPLED.temperature, top_k=SAMPLED.top_k,
                       top_p=SAMPLED.top_p, max_tokens=20, seed=7 + i)
        for i in range(2)
    ]


def _run_mtad(target: str, draft: str, prompts: list[list[int]], hetero: bool) -> dict:
    eng = start_engine(
        target, draft, K, num_beams=BEAMS,
        spec_extra={"use_heterogeneous_vocab": True} if hetero else None, **ENGINE_KW,
    )
    try:
        before = _counters(eng.llm)
        greedy = eng.generate(prompts, _greedy_params())
        counters = {k: v - before[k] for k, v in _counters(eng.llm).items()}
        greedy_records = list(eng.records)
        short = [prompts[0], prompts[3]]
        sampled = eng.generate(short, _sampled_params())
        sampled_records = list(eng.records)
        sampled_again = eng.generate(short, _sampled_params())
        mapping = getattr(eng.drafter, "vocab_mapping", None)
        return dict(greedy=greedy, greedy_records=greedy_records, counters=counters,
                    sampled=sampled, sampled_records=sampled_records,
                    sampled_again=sampled_again, engine=eng,
                    intersection=None if mapping is None else mapping.intersection_size)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def runs(setup):
    from vllm.inputs import TokensPrompt

    from vllm_specx.engine import running_llm

    with running_llm(setup["target"], skip_tokenizer_init=True, **ENGINE_KW) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in setup["prompts"]],
                            _greedy_params(), use_tqdm=False)
        plain = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                 for o in outs}
    result = {"plain": plain}
    result["same"] = _run_mtad(setup["target"], setup["draft"], setup["prompts"], False)
    for name in ("renumbered", "missing"):
        result[name] = _run_mtad(
            setup["target"], str(setup[name].path), setup["prompts"], True
        )
    return result


def _by_order(outputs: dict[str, list[int]]) -> list[list[int]]:
    return [outputs[k] for k in sorted(outputs, key=int)]


def _vocab(setup, name: str) -> DraftVocab:
    return DraftVocab.from_source_ids(
        setup[name].source_id, target_vocab=len(setup["tok"]),
        fallback=setup["tok"].eos_token_id,
    )


def test_rewritten_drafts_differ_where_it_matters(setup):
    """The fixture has teeth: ids moved, draft-only tokens would be drafted unless
    excluded, and the prompts contain tokens the second draft lacks."""
    from transformers import AutoModelForCausalLM

    renumbered, missing = setup["renumbered"], setup["missing"]
    moved = sum(new != old for new, old in enumerate(renumbered.source_id) if old >= 0)
    assert moved > 4000
    vocab = _vocab(setup, "renumbered")
    draft = AutoModelForCausalLM.from_pretrained(renumbered.path, dtype=torch.float32).eval()
    prompt = setup["prompts"][2]
    with torch.no_grad():
        top = draft(input_ids=torch.tensor([vocab.draft_ids(prompt)])).logits[0].argmax(-1)
    assert (vocab.to_target[top] < 0).float().mean() > 0.3
    missing_vocab = _vocab(setup, "missing")
    fallback = setup["tok"].eos_token_id
    lost = [t for p in setup["prompts"] for t in p if missing_vocab.to_draft[t] == fallback
            and t != fallback]
    assert len(lost) >= 16 and len(missing.dropped) == 16


def test_greedy_output_equals_non_speculative(runs):
    plain = _by_order(runs["plain"])
    for name in ("same", "renumbered", "missing"):
        assert _by_order(runs[name]["greedy"]) == plain, name


def test_renumbered_draft_drafts_exactly_like_the_original(setup, runs):
    same, renum = runs["same"], runs["renumbered"]
    assert renum["intersection"] == len(setup["tok"])  # every target token is shared
    a, b = same["greedy_records"], renum["greedy_records"]
    assert len(a) == len(b) > 20
    for ra, rb in zip(a, b):
        assert (ra.req_id, ra.position, ra.tokens) == (rb.req_id, rb.position, rb.tokens)
        assert rb.q == pytest.approx(ra.q, rel=1e-5, abs=1e-7)
    assert renum["counters"] == same["counters"]
    assert same["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_missing_tokens_drafts_match_reference(setup, runs):
    from transformers import AutoModelForCausalLM

    run = runs["missing"]
    assert run["intersection"] == len(setup["tok"]) - 16
    vocab = _vocab(setup, "missing")
    hf = AutoModelForCausalLM.from_pretrained(setup["missing"].path, dtype=torch.float32)
    draft = SharedVocabDraft(hf.eval(), vocab)
    eng = run["engine"]
    prompts = setup["prompts"]

    eng.records = run["greedy_records"]
    ids = sorted(run["greedy"], key=int)
    lens = {rid: len(p) for rid, p in zip(ids, prompts)}
    greedy = {rid: Warping(temperature=0.0) for rid in ids}
    checked, partial = check_rounds_against_reference(
        eng, run["greedy"], lens, draft, greedy, K, vocab=vocab
    )
    assert checked >= 20 and partial >= 1
    assert run["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0

    eng.records = run["sampled_records"]
    ids = sorted(run["sampled"], key=int)
    lens = {rid: len(p) for rid, p in zip(ids, [prompts[0], prompts[3]])}
    checked, _ = check_rounds_against_reference(
        eng, run["sampled"], lens, draft, dict.fromkeys(ids, SAMPLED), K, vocab=vocab
    )
    assert checked >= 5


def test_seeded_sampling_reproduces(runs):
    for name in ("same", "renumbered", "missing"):
        run = runs[name]
        assert _by_order(run["sampled"]) == _by_order(run["sampled_again"]), name


def test_without_the_flag_vllm_refuses_a_different_vocabulary(setup):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=setup["target"], skip_tokenizer_init=True,
        speculative_config={"method": "mtad", "model": str(setup["renumbered"].path)},
    )
    with pytest.raises(ValueError, match="same vocabulary size"):
        args.create_engine_config()
