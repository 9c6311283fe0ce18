"""``specx_mtp`` and ``specx_eagle3`` on Model Runner V2 (CPU platform, Triton interpreter).

At a fixed K these methods draft on V2 with vLLM's own V2 speculator (``MTPSpeculator``,
``EagleSpeculator``; glue/v2_eagle.py keeps their ``propose``), with ``adaptive: true``
with the V1 chain round after vLLM's first pass; they verify with the specx sampler
(``SpecxV2RejectionSampler``, glue/v2_sampler.py), which replaces V2's
``RejectionSampler`` after ``load_model``.

``specx_mtp`` on the MTP fixture (DeepSeek-V3 architecture, MLA; vLLM turns chunked
prefill and prefix caching off for MLA on CPU), one plain and one specx engine with a KV
cache too small for the "many" batch:

* greedy output equals V2 without speculation (ragged prompts), drafts accepted and
  rejected; a stop token and a length limit that end requests mid-draft; preemption;
* seeded sampled requests (temperature 1, top-k 3): two-token outputs follow the target's
  exact distribution (chi-square) and seeds reproduce;
* ``adaptive: true`` (a third engine): greedy output equals no speculation, a stop token
  mid-draft, and the scheduler sees ragged draft lengths; with cost control forced to
  plan zero on runs of steps (tests/idle_steps.py), those steps skip the MTP layer's
  first pass and its KV is caught up (drafts and first passes equal to those with every
  first pass run).

``specx_eagle3`` with the adaptive stop (fixture target + the test EAGLE-3 head, whose
auxiliary layer ids only ``eagle_config`` holds, which V2 itself does not read): greedy
output equals V2 without speculation, drafts ragged. On these synthetic prompts neither
runner accepts this head's drafts (vLLM's own ``eagle3`` neither); on held-out text both
accept the same (docs/model-runners.md), so the idle-step runs (as for ``specx_mtp``) use
the held-out prompts (prefix caching: block ends caught up too).
"""

from __future__ import annotations

from typing import Any

import pytest
from idle_steps import check_idle_steps, check_retirement
from v2_cases import GREEDY, MTP_TARGET, PROMPTS, TARGET, build_eagle3_head, heldout_prompts

pytestmark = pytest.mark.engine

K = 3
ADAPTIVE_K = 4  # the adaptive engines' K
N_STAT = 160
STAT_TOP_K = 3
STAT_PROMPT = PROMPTS[1][:9]
# MLA: no chunked prefill, so a step must hold a whole prompt. MLA KV is 2.25 KiB per
# token and layer (3 target layers + the MTP layer): 1.5 MiB holds ~167 tokens with the
# MTP layer, more than one request needs (max_model_len 128), less than the 8 "many"
# requests (8 x ~40 tokens): the scheduler preempts.
MTP_KWARGS: dict[str, Any] = dict(
    max_model_len=128, max_num_batched_tokens=128, enable_prefix_caching=False,
    max_num_seqs=16, kv_cache_memory_bytes=3 * 2**19, skip_tokenizer_init=True,
)
MANY = [[(11 * i + 5 * j) % 400 + 20 for i in range(24)] for j in range(8)]
COUNTERS = "vllm_specx.testing.v2_engine:spec_decode_counters"
LOGPROBS = "vllm_specx.testing.v2_engine:generate_with_logprobs"
GREEDY_LOGPROBS = dict(GREEDY, max_tokens=6, logprobs=1)


@pytest.fixture(scope="module")
def mtp(v2_engine, v2_host) -> dict[str, Any]:
    plain = v2_engine("mtp_plain", MTP_TARGET, **MTP_KWARGS)
    assert plain["speculator"] is None
    ref = {"ragged": v2_host.generate("mtp_plain", PROMPTS, GREEDY),
           "many": v2_host.generate("mtp_plain", MANY, GREEDY),
           "logprobs": v2_host.call("mtp_plain", LOGPROBS, PROMPTS[:2], GREEDY_LOGPROBS)}
    v2_host.stop("mtp_plain")
    spec = {"method": "specx_mtp", "num_speculative_tokens": K}
    return {"ref": ref,
            "description": v2_engine("specx_mtp", MTP_TARGET, speculative_config=spec,
                                     **MTP_KWARGS)}


def _delta(v2_host, key: str, run) -> tuple[Any, dict[str, float]]:
    before = v2_host.call(key, COUNTERS)
    out = run()
    after = v2_host.call(key, COUNTERS)
    return out, {k: after[k] - before.get(k, 0.0) for k in after}


def test_specx_mtp_runs_on_v2_with_vllm_drafting_and_the_specx_sampler(mtp):
    d = mtp["description"]
    assert d["v2"]
    # vLLM's MTPSpeculator (its own propose at a fixed K), the specx round with adaptive.
    assert d["speculator"] == "vllm_specx.glue.v2_eagle.MtpChainV2Speculator"
    assert d["rejection_sampler"] == "vllm_specx.glue.v2_sampler.SpecxV2RejectionSampler"


def _only_engine(v2_host) -> None:
    """Stop every engine in the host before starting another: stopping an engine tears
    down vLLM's process-wide parallel state, which one still running would need."""
    for key in list(v2_host.running):
        v2_host.stop(key)


def _assert_ragged(c: dict[str, float], k: int) -> None:
    """The scheduler saw each request's own draft length: between 1 and K per draft, and
    not K for every one."""
    assert c["num_drafts"] < c["num_draft_tokens"] < k * c["num_drafts"]


def test_specx_mtp_greedy_equals_no_speculation(mtp, v2_host):
    out, c = _delta(v2_host, "specx_mtp", lambda: v2_host.generate("specx_mtp", PROMPTS, GREEDY))
    assert out == mtp["ref"]["ragged"]
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"]


def test_specx_mtp_logprobs_equal_no_speculation(mtp, v2_host):
    """The emitted tokens' logprobs come out of V2's own logprob path around the specx
    sampler, for accepted drafts and bonus tokens alike."""
    out = v2_host.call("specx_mtp", LOGPROBS, PROMPTS[:2], GREEDY_LOGPROBS)
    ref = mtp["ref"]["logprobs"]
    assert [[t for t, _ in row] for row in out] == [[t for t, _ in row] for row in ref]
    for row, ref_row in zip(out, ref):
        assert [lp for _, lp in row] == pytest.approx([lp for _, lp in ref_row], abs=1e-4)


def test_specx_mtp_stops_mid_draft_like_no_speculation(mtp, v2_host):
    ref = mtp["ref"]["ragged"]
    stop = ref[2][4]
    sampling = [dict(GREEDY, stop_token_ids=[stop]), dict(GREEDY, max_tokens=5)]
    out = v2_host.generate("specx_mtp", [PROMPTS[2], PROMPTS[1]], sampling)
    assert out[0] == ref[2][: ref[2].index(stop) + 1]
    assert out[1] == ref[1][:5]


def test_specx_mtp_greedy_under_preemption(mtp, v2_host):
    before = v2_host.call("specx_mtp", "vllm_specx.testing.v2_engine:preemption_count")
    out = v2_host.generate("specx_mtp", MANY, GREEDY)
    after = v2_host.call("specx_mtp", "vllm_specx.testing.v2_engine:preemption_count")
    assert after > before
    assert out == mtp["ref"]["many"]


def _exact_distribution(model_dir: str, prompt: list[int], length: int = 2,
                        top_k: int = STAT_TOP_K) -> dict[tuple[int, ...], float]:
    """p(t1 .. t_length | prompt) at temperature 1 and top-k, enumerated (top_k ** length
    sequences): vLLM without speculation is not exact; the transformers model is. Also
    the draft-tree chi-square test's reference (test_v2_trees.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def top(ctx: list[int]) -> list[tuple[int, float]]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
        vals, idx = logits.topk(top_k)
        return list(zip(idx.tolist(), vals.softmax(-1).tolist()))

    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        dist = {(*seq, t): p * pt for seq, p in dist.items()
                for t, pt in top(prompt + list(seq))}
    return dist


def _exact_two_token_distribution(model_dir: str,
                                  prompt: list[int]) -> dict[tuple[int, ...], float]:
    """p(t1, t2 | prompt) at temperature 1, top-k STAT_TOP_K (9 sequences)."""
    return _exact_distribution(model_dir, prompt, 2)


def test_specx_sampler_on_v2_samples_the_target_distribution(mtp, v2_host):
    """Chi-square of seeded two-token samples against the target's exact distribution:
    the second token always comes out of the specx sampler (the MTP draft accepted with
    probability p(x), or the residual p without x)."""
    from scipy.stats import chisquare

    params = [dict(temperature=1.0, top_k=STAT_TOP_K, seed=i, max_tokens=2)
              for i in range(N_STAT)]
    out, c = _delta(v2_host, "specx_mtp", lambda: v2_host.generate(
        "specx_mtp", [STAT_PROMPT] * N_STAT, params))
    samples = [tuple(t) for t in out]
    assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"]
    dist = _exact_two_token_distribution(MTP_TARGET, STAT_PROMPT)
    assert set(samples) <= set(dist)
    counts = {k: samples.count(k) for k in dist}
    big = [k for k in dist if dist[k] * len(samples) >= 5]
    small = [k for k in dist if k not in big]
    observed = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
    expected = [dist[k] * len(samples) for k in big] + (
        [sum(dist[k] for k in small) * len(samples)] if small else [])
    scale = sum(observed) / sum(expected)
    _, p_value = chisquare(observed, [e * scale for e in expected])
    assert p_value > 1e-3, (p_value, observed, expected)
    again = v2_host.generate("specx_mtp", [STAT_PROMPT] * 16, params[:16])
    assert [tuple(t) for t in again] == samples[:16]


def run_idle(llm: Any, prompts: list[list[int]], k: int,
             max_hole: int | None = None) -> dict[str, Any]:
    """Runs in the V2 host: tests/idle_steps.py's two runs of ``prompts`` (greedy,
    MAX_TOKENS) under the same scripted plans, skipping the head's first pass on all-zero
    steps and with every first pass run, each from an empty prefix cache. ``max_hole``:
    the hole record's bound on a request's kept positions."""
    from idle_steps import run_idle_steps
    from vllm import SamplingParams

    from vllm_specx.testing.v2_engine import runner_of

    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
    return run_idle_steps(llm, runner_of(llm).speculator, k, prompts, params,
                          max_hole=max_hole, fresh_prefix_cache=True)


def run_retire(llm: Any, prompts: list[list[int]], k: int) -> dict[str, Any]:
    """Runs in the V2 host: tests/idle_steps.py's retirement runs of ``prompts`` (greedy,
    MAX_TOKENS), from an empty prefix cache."""
    from idle_steps import run_retirement
    from vllm import SamplingParams

    from vllm_specx.testing.v2_engine import runner_of

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY["max_tokens"], ignore_eos=True)
    return run_retirement(llm, runner_of(llm).speculator, k, prompts, params)


@pytest.fixture(scope="module")
def eagle3_adaptive(v2_engine, v2_host, tmp_path_factory) -> dict[str, Any]:
    """specx_eagle3 with the adaptive confidence stop on V2, over the test head (its
    auxiliary layer ids in eagle_config only): PROMPTS greedy with the configured
    ``"cost_control": false``, then the idle-step runs on the held-out prompts (where
    the head's drafts are accepted). One engine, stopped after."""
    _only_engine(v2_host)
    head = build_eagle3_head(str(tmp_path_factory.mktemp("v2_eagle3_head")))
    d = v2_engine("specx_eagle3", TARGET, speculative_config={
        "method": "specx_eagle3", "model": head, "num_speculative_tokens": ADAPTIVE_K,
        "adaptive": True, "confidence_threshold": 0.3, "cost_control": False})
    out, c = _delta(v2_host, "specx_eagle3",
                    lambda: v2_host.generate("specx_eagle3", PROMPTS, GREEDY))
    idle = v2_host.call("specx_eagle3", f"{__name__}:run_idle", heldout_prompts(), ADAPTIVE_K)
    retire = v2_host.call("specx_eagle3", f"{__name__}:run_retire", heldout_prompts(),
                          ADAPTIVE_K)
    v2_host.stop("specx_eagle3")
    return {"description": d, "out": out, "counters": c, "idle": idle, "retire": retire}


def test_specx_eagle3_adaptive_greedy_equals_no_speculation(eagle3_adaptive, v2_reference):
    """Greedy == no speculation, ragged drafts."""
    d = eagle3_adaptive["description"]
    assert d["speculator"] == "vllm_specx.glue.v2_eagle.EagleChainV2Speculator"
    assert d["rejection_sampler"] == "vllm_specx.glue.v2_sampler.SpecxV2RejectionSampler"
    assert eagle3_adaptive["out"] == v2_reference
    _assert_ragged(eagle3_adaptive["counters"], ADAPTIVE_K)


def test_steps_where_nobody_drafts_skip_the_eagle3_first_pass_on_v2(eagle3_adaptive,
                                                                   v2_heldout_reference):
    """specx_eagle3 on V2 with cost control planning zero drafts for every request on
    runs of one and four steps (tests/idle_steps.py): those steps skip vLLM's first pass,
    keeping its inputs (the tokens and the target's auxiliary hidden states, uncombined);
    the next first pass that runs, and block ends under prefix caching, catch the head's
    KV up first. Greedy output equals no speculation and every round's drafts equal those
    of the same plans with every first pass run (a catch-up that writes nothing fails)."""
    idle = eagle3_adaptive["idle"]
    check_idle_steps(idle, v2_heldout_reference)
    assert idle["holes"]["block_end_catch_ups"] > 0


def test_a_request_idle_for_long_retires_from_drafting_on_v2(eagle3_adaptive, v2_heldout_reference):
    """On V2 as on V1: after ``retire_after`` skipped steps in a row (here 3) a request's
    head KV upkeep stops and it is planned nothing from then on; greedy output equals no
    speculation, and new requests draft as usual."""
    check_retirement(eagle3_adaptive["retire"], v2_heldout_reference)


@pytest.fixture(scope="module")
def mtp_adaptive(mtp, v2_engine, v2_host) -> dict[str, Any]:
    """specx_mtp with the adaptive stop on V2 (``"cost_control": false`` as configured): a
    stop token ending one request mid-draft, then the idle-step runs on PROMPTS. One
    engine, stopped after."""
    _only_engine(v2_host)
    d = v2_engine("specx_mtp_adaptive", MTP_TARGET, speculative_config={
        "method": "specx_mtp", "num_speculative_tokens": ADAPTIVE_K, "adaptive": True,
        "cost_control": False}, **MTP_KWARGS)
    ref = mtp["ref"]["ragged"]
    stop = ref[2][4]
    sampling = [GREEDY, GREEDY, dict(GREEDY, stop_token_ids=[stop])]
    out, c = _delta(v2_host, "specx_mtp_adaptive",
                    lambda: v2_host.generate("specx_mtp_adaptive", PROMPTS, sampling))
    idle = v2_host.call("specx_mtp_adaptive", f"{__name__}:run_idle", PROMPTS, ADAPTIVE_K, 3)
    v2_host.stop("specx_mtp_adaptive")
    return {"description": d, "out": out, "counters": c, "stop": stop, "idle": idle}


def test_specx_mtp_adaptive_on_v2_greedy_ragged(mtp, mtp_adaptive):
    """The adaptive stop on V2 (the V1 chain round over vLLM's V2 MTP first pass): greedy
    output equals no speculation, with a stop token ending one request mid-draft, and the
    scheduler gets ragged draft lengths (G2's v2_ragged_draft_lengths)."""
    assert mtp_adaptive["description"]["speculator"] == (
        "vllm_specx.glue.v2_eagle.MtpChainV2Speculator")
    ref, out, stop = mtp["ref"]["ragged"], mtp_adaptive["out"], mtp_adaptive["stop"]
    assert out[:2] == ref[:2]
    assert out[2] == ref[2][: ref[2].index(stop) + 1]
    c = mtp_adaptive["counters"]
    assert 0 < c["num_accepted_tokens"]
    _assert_ragged(c, ADAPTIVE_K)


def test_steps_where_nobody_drafts_skip_the_mtp_first_pass_on_v2(mtp, mtp_adaptive):
    """specx_mtp on V2 (MLA target, no prefix caching) as the EAGLE-3 test above: the
    skipped first passes keep the target's final hidden states, the catch-ups feed them
    back, and the drafts and the greedy output are those with every first pass run. With
    holes bounded at 3 positions (HeadKVHoles.max_hole; 64 by default), all-zero steps
    that would pass the bound run their first pass (planned after it), catch-up first."""
    idle = mtp_adaptive["idle"]
    check_idle_steps(idle, mtp["ref"]["ragged"])
    assert idle["holes"]["refused_skips"] > 0
