"""Benchmark arithmetic: from per-request traces and counters to every reported number.

Pure Python (no vLLM, no torch, no numpy) so it can be checked on hand-made traces.

Definitions (N = generated tokens, all sums over the requests of one configuration)
-----------------------------------------------------------------------------------
A *target forward* of a request is one engine step that emitted tokens for it: the
prefill step (its first token) and every decode step. In a decode step the target
verifies the scheduled drafts and emits ``1 + accepted`` tokens (the accepted drafts
plus one token of its own), except that the step that reaches ``max_tokens`` or a stop
condition emits fewer: vLLM trims the surplus. So we never infer forwards from
acceptance counters; the engine loop records what each step emitted.

* ``target_forward_passes`` N_t: sum of target forwards.
* ``verification_rate`` = N_t / N (SpecDec++ eq. 2.3; 1 without speculation).
* ``block_efficiency`` = N / N_t (its inverse: tokens per target forward).
* ``drafted_tokens`` D: draft tokens the drafter produced (vLLM's scheduled count, or the
  drafter's own count when it reports one, see padding).
* ``emitted_draft_tokens`` E = N - N_t: drafts that ended up in the output.
* ``discarded_tokens`` = D - E: drafts rejected by the target or cut off by the stop
  condition (accepted drafts beyond ``max_tokens`` are work thrown away too).
  ``discard_rate`` = (D - E) / N (SpecDec++ eq. 2.3).
* ``mean_acceptance_length`` = 1 + A / V with A the drafts the target accepted (before
  trimming) and V the verification steps that carried drafts: vLLM's own definition.
* ``acceptance_per_position[i]`` = (steps accepting position i) / (steps drafting a token
  at position i). Acceptance is a prefix, so "accepting i" means accepted > i. For a fixed
  draft length this is vLLM's ``accepted_per_pos / num_drafts``; for adaptive lengths it
  conditions on the position having been drafted.
* ``draft_forward_passes`` N_draft: draft-model forwards a request took part in. From the
  drafter when it reports them; else verification steps x (draft forwards per drafting
  round, counted by the benchmark's hooks); else one per drafted token. A drafter also
  drafts rounds nobody verifies (after a request's last step); when it reports its
  request-rounds, its counts are scaled by verification steps / request-rounds, so every
  drafter is charged for the verified rounds only.
* ``padding_ratio`` = (scheduled - needed) / needed verification positions, where a
  verification step of a request with k drafts needs k + 1 query positions (the drafts and
  the position after them). vLLM packs verification ragged and schedules exactly the
  drafted tokens, so the ratio is 0 by construction unless a drafter reports that it
  scheduled more tokens than it really drafted (``DrafterStats``).
* ``mean_draft_length`` = D / V and ``draft_length_histogram[k]``: verification steps
  that carried k drafts (adaptive drafters draft different lengths per request and round).
* ``oracle_projected_speedup``: the hindsight oracle of SpecDec++ (Lemma 2.1) on the same
  rounds: each round drafts exactly the tokens the target accepted and stops before the
  first rejection, so it emits the same tokens with the same target forwards, discards
  nothing and pays one draft forward per accepted token (N_draft = A). An upper bound
  for any stop rule driving this drafter on these rounds.
* ``perplexity`` = exp(-sum log p_target(token) / N), token-weighted over all requests,
  from the target's own log-probabilities of the emitted tokens.

Projected speed-up (SpecDec++ eqs. 2.1-2.3)
-------------------------------------------
Total time T = t_draft * N_draft + t_target * N_target (2.1). For a drafter that runs one
draft forward per drafted token, N_draft = N_discard + N - N_target (the identity behind
eq. 2.2), hence per generated token (2.3)::

    T / N = t_draft * (discard_rate + 1 - verification_rate) + t_target * verification_rate

Without speculation T / N = t_target, so::

    projected_speedup = t_target / (t_draft * N_draft / N + t_target * N_target / N)

A drafter whose forwards are not one per drafted token (e.g. a beam search) reports its
real ``draft_forward_passes``; drafters that run no model (ngram) have t_draft = 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SPEEDUP_FORMULA = (
    "projected_speedup = t_target / (t_draft * N_draft/N + t_target * N_target/N) "
    "(SpecDec++ eq. 2.1 per generated token; without speculation T/N = t_target). For one "
    "draft forward per drafted token N_draft = N_discard + N - N_target, i.e. eq. 2.3: "
    "T/N = t_draft*(discard_rate + 1 - verification_rate) + t_target*verification_rate"
)


@dataclass
class RequestTrace:
    """What the engine did for one request.

    ``step_tokens``: tokens emitted by each target forward that emitted any, in order (the
    first is the prefill's). ``logprobs``: the target's log-probability of each emitted
    token (``None`` where the engine returned none). ``drafted_per_step`` /
    ``accepted_per_step``: for each verification step that carried drafts, the drafts
    scheduled and the drafts the target accepted (before trimming at the stop condition).
    """

    step_tokens: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass(frozen=True)
class DrafterStats:
    """Counts a specx drafter may report about its own work (each optional).

    ``drafted_tokens``: tokens it really drafted; ``scheduled_tokens``: tokens it handed to
    the scheduler for verification (more than drafted if it padded); ``draft_forward_passes``:
    draft-model forwards, counted per request (a batched forward over r requests counts r).
    """

    drafted_tokens: int | None = None
    scheduled_tokens: int | None = None
    draft_forward_passes: int | None = None
    # Request-rounds the drafter drafted for. It also drafts after a request's last step
    # (and during partial prefills), rounds nobody verifies and that the hook-counted
    # drafters are not charged for; with this count its numbers are scaled to the
    # verified rounds, so both are compared on the same rounds.
    request_rounds: int | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> DrafterStats | None:
        if not data:
            return None

        def get(key: str) -> int | None:
            value = data.get(key)
            return int(value) if isinstance(value, (int, float)) else None

        stats = cls(get("drafted_tokens"), get("scheduled_tokens"), get("draft_forward_passes"),
                    get("requests"))
        if stats == cls():
            return None
        return stats


@dataclass(frozen=True)
class Counts:
    """Sums over the requests of one configuration (see module doc for the symbols)."""

    requests: int
    generated_tokens: int  # N
    target_forward_passes: int  # N_t
    verification_steps: int  # V: steps that carried drafts
    drafted_tokens: int  # D as scheduled by vLLM
    accepted_tokens: int  # A, before trimming
    accepted_per_position: tuple[int, ...]
    drafted_per_position: tuple[int, ...]
    logprob_sum: float
    logprob_tokens: int
    truncated_requests: int  # requests whose last step emitted fewer than 1 + accepted


def aggregate(traces: Sequence[RequestTrace]) -> tuple[Counts, list[str]]:
    """Sum the traces; also return human-readable warnings for inconsistent traces."""
    warnings: list[str] = []
    n = n_t = v = d = a = 0
    acc_pos: list[int] = []
    dr_pos: list[int] = []
    lp_sum = 0.0
    lp_n = 0
    truncated = 0
    for idx, tr in enumerate(traces):
        gen = sum(tr.step_tokens)
        fwd = len(tr.step_tokens)
        if any(t <= 0 for t in tr.step_tokens):
            warnings.append(f"request {idx}: a recorded step emitted no token")
        if len(tr.drafted_per_step) != len(tr.accepted_per_step):
            raise ValueError(f"request {idx}: drafted/accepted step lists differ in length")
        acc = sum(tr.accepted_per_step)
        for k, (dk, ak) in enumerate(zip(tr.drafted_per_step, tr.accepted_per_step)):
            if not 0 <= ak <= dk:
                raise ValueError(f"request {idx} step {k}: accepted {ak} of {dk} drafts")
            _bump(dr_pos, dk)
            _bump(acc_pos, ak)
        emitted_drafts = gen - fwd
        # Trimming only removes tokens, so the output can hold at most the accepted drafts;
        # more would mean two forwards were recorded as one step.
        if emitted_drafts > acc:
            warnings.append(
                f"request {idx}: {emitted_drafts} draft tokens emitted but only {acc} "
                "accepted (engine steps merged in the trace?)"
            )
        elif emitted_drafts < acc:
            truncated += 1
        if tr.logprobs and len(tr.logprobs) != gen:
            warnings.append(f"request {idx}: {len(tr.logprobs)} logprobs for {gen} tokens")
        for lp in tr.logprobs:
            if lp is not None and math.isfinite(lp):
                lp_sum += lp
                lp_n += 1
        n += gen
        n_t += fwd
        v += len(tr.drafted_per_step)
        d += sum(tr.drafted_per_step)
        a += acc
    # A position drafted but never accepted still has a rate (0), so the accepted counts
    # cover every drafted position.
    acc_pos.extend([0] * (len(dr_pos) - len(acc_pos)))
    counts = Counts(
        requests=len(traces),
        generated_tokens=n,
        target_forward_passes=n_t,
        verification_steps=v,
        drafted_tokens=d,
        accepted_tokens=a,
        accepted_per_position=tuple(acc_pos),
        drafted_per_position=tuple(dr_pos),
        logprob_sum=lp_sum,
        logprob_tokens=lp_n,
        truncated_requests=truncated,
    )
    return counts, warnings


def _bump(per_pos: list[int], upto: int) -> None:
    """Add one to positions 0..upto-1 (a prefix of length ``upto``)."""
    if len(per_pos) < upto:
        per_pos.extend([0] * (upto - len(per_pos)))
    for i in range(upto):
        per_pos[i] += 1


def draft_length_histogram(traces: Sequence[RequestTrace]) -> dict[str, int]:
    """{k: verification steps that carried k drafts} over all requests (keys as strings,
    sorted, so the report's JSON reads the same everywhere)."""
    hist: dict[int, int] = {}
    for tr in traces:
        for k in tr.drafted_per_step:
            hist[k] = hist.get(k, 0) + 1
    return {str(k): hist[k] for k in sorted(hist)}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def perplexity(logprob_sum: float, tokens: int) -> float | None:
    """exp of the mean negative log-probability; None without tokens."""
    if tokens <= 0:
        return None
    return math.exp(-logprob_sum / tokens)


def projected_speedup(
    verification_rate: float | None,
    draft_forwards_per_token: float,
    t_target: float | None,
    t_draft: float | None,
) -> float | None:
    """SpecDec++ eq. 2.3 over the no-speculation time per token (t_target).

    Only the cost ratio matters: speedup = 1 / (verification_rate + c * draft_forwards/N)
    with c = t_draft / t_target. None when a cost or the rate is unknown.
    """
    if verification_rate is None or t_target is None or t_draft is None or t_target <= 0:
        return None
    per_token = t_draft * draft_forwards_per_token + t_target * verification_rate
    return t_target / per_token if per_token > 0 else None


def median_cost_ratio(configs: Iterable[Mapping[str, Any]]) -> float | None:
    """The median draft/target cost ratio (t_draft_s / t_target_s) over a report's
    configurations that measured both, or None. Re-projecting every row of a report with
    this one ratio compares configurations by their counts, not by timer noise."""
    ratios = [
        c["t_draft_s"] / c["t_target_s"]
        for c in configs
        if c.get("t_draft_s") and c.get("t_target_s")
    ]
    return statistics.median(ratios) if ratios else None


def config_metrics(
    traces: Sequence[RequestTrace],
    *,
    drafter: DrafterStats | None = None,
    draft_forwards_per_round: float | None = None,
    t_target: float | None = None,
    t_draft: float | None = None,
    wall_s: float | None = None,
    baseline_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    """Every derived number of one configuration (the report's per-config keys).

    ``t_draft`` is the cost of one draft forward (0 for model-free drafters, None when
    unknown). ``baseline_tokens_per_s`` turns the projected speed-up into tokens/s and the
    measured wall clock into a measured speed-up.
    """
    c, warnings = aggregate(traces)
    n = c.generated_tokens
    emitted_drafts = n - c.target_forward_passes
    scheduled = c.drafted_tokens
    drafted = c.drafted_tokens
    padding_source = "vllm-scheduler"
    # The share of the drafter's own counts that belongs to verified rounds.
    verified_share = 1.0
    if drafter is not None and drafter.request_rounds:
        verified_share = min(1.0, c.verification_steps / drafter.request_rounds)
    if drafter is not None:
        if drafter.scheduled_tokens is not None:
            scheduled = round(drafter.scheduled_tokens * verified_share)
        if drafter.drafted_tokens is not None:
            drafted = round(drafter.drafted_tokens * verified_share)
            padding_source = "drafter"
    discarded = drafted - emitted_drafts
    if discarded < 0:
        warnings.append(f"negative discard count {discarded}: drafted tokens under-reported")
    needed = drafted + c.verification_steps
    padded = scheduled + c.verification_steps
    padding_ratio = (padded - needed) / needed if needed else 0.0
    draft_forwards: float = drafted
    draft_forward_source = "one per drafted token"
    if drafter is not None and drafter.draft_forward_passes is not None:
        draft_forwards = drafter.draft_forward_passes * verified_share
        draft_forward_source = "drafter" + (
            ", scaled to the verified rounds" if verified_share < 1.0 else "")
    elif draft_forwards_per_round is not None:
        # Every request in a drafting round takes part in all of its (batched) draft
        # forwards: a beam search's extra passes are counted, an early stop's saved ones
        # are not.
        draft_forwards = c.verification_steps * draft_forwards_per_round
        draft_forward_source = "draft-model forwards per drafting round x verification steps"

    verification_rate = _ratio(c.target_forward_passes, n)
    speedup = projected_speedup(
        verification_rate, draft_forwards / n if n else 0.0, t_target, t_draft
    )
    oracle_speedup = projected_speedup(
        verification_rate, c.accepted_tokens / n if n else 0.0, t_target, t_draft
    )
    tokens_per_s = _ratio(n, wall_s) if wall_s else None
    acc_per_pos = [
        acc / dr for acc, dr in zip(c.accepted_per_position, c.drafted_per_position) if dr
    ]
    return {
        "requests": c.requests,
        "generated_tokens": n,
        "target_forward_passes": c.target_forward_passes,
        "verification_steps": c.verification_steps,
        "drafted_tokens": drafted,
        "scheduled_draft_tokens": scheduled,
        "accepted_tokens": c.accepted_tokens,
        "emitted_draft_tokens": emitted_drafts,
        "discarded_tokens": discarded,
        "draft_forward_passes": draft_forwards,
        "draft_forward_passes_source": draft_forward_source,
        "truncated_requests": c.truncated_requests,
        "verification_rate": verification_rate,
        "discard_rate": _ratio(discarded, n),
        "block_efficiency": _ratio(n, c.target_forward_passes),
        "mean_acceptance_length": (
            1.0 + c.accepted_tokens / c.verification_steps if c.verification_steps else 1.0
        ),
        "acceptance_per_position": acc_per_pos,
        "accepted_per_position": list(c.accepted_per_position),
        "drafted_per_position": list(c.drafted_per_position),
        "draft_acceptance_rate": _ratio(c.accepted_tokens, c.drafted_tokens),
        "padding_ratio": padding_ratio,
        "padding_source": padding_source,
        "mean_draft_length": _ratio(c.drafted_tokens, c.verification_steps),
        "draft_length_histogram": draft_length_histogram(traces),
        "perplexity": perplexity(c.logprob_sum, c.logprob_tokens),
        "perplexity_tokens": c.logprob_tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens_per_s,
        "measured_speedup": (
            tokens_per_s / baseline_tokens_per_s
            if tokens_per_s is not None and baseline_tokens_per_s
            else None
        ),
        "projected_speedup": speedup,
        "oracle_projected_speedup": oracle_speedup,
        "projected_tokens_per_s": (
            speedup * baseline_tokens_per_s
            if speedup is not None and baseline_tokens_per_s
            else None
        ),
        "warnings": warnings,
    }


@dataclass(frozen=True)
class StepTiming:
    """One engine step as seen by the benchmark loop: wall seconds since the previous
    step returned, and whether any request received its first token in it (prefill)."""

    seconds: float
    prefill: bool
    requests: int


def forward_cost(steps: Iterable[StepTiming]) -> dict[str, Any]:
    """Per-forward cost of a no-speculation run: statistics of its decode-only steps.

    Each decode step of a run without speculation is exactly one batched target forward, so
    its wall time is the forward's cost at that batch. The median is the cost used (robust
    to a shared machine's hiccups); the mean and the count are recorded with it. Steps with
    fewer requests than the run's largest batch (the tail, as requests finish) are left out
    so that two models are compared at the same batch.
    """
    decode = [s for s in steps if not s.prefill]
    if not decode:
        return {"seconds": None, "mean_s": None, "steps": 0, "batch": None}
    batch = max(s.requests for s in decode)
    full = [s.seconds for s in decode if s.requests == batch]
    return {
        "seconds": statistics.median(full),
        "mean_s": statistics.fmean(full),
        "steps": len(full),
        "batch": batch,
    }


def forward_time_stats(record: Mapping[str, Sequence[float]] | None) -> dict[str, Any]:
    """Per-forward cost of one model from its timed calls (see the runner's forward timers).

    ``record``: ``forward_s`` and ``tokens`` per ``forward`` call, ``logits_s`` per
    ``compute_logits`` call. The cost of a forward is the median duration of the calls with
    the most common token count (for a batch of decoding requests: one token each; prefill
    and a drafter's first pass over the accepted tokens have other counts) plus the median
    ``compute_logits`` duration. ``total_s`` is everything recorded (forward + logits).
    """
    forward = list((record or {}).get("forward_s") or [])
    tokens = list((record or {}).get("tokens") or [])
    logits = list((record or {}).get("logits_s") or [])
    total = sum(forward) + sum(logits)
    if not forward:
        return {"seconds": None, "forward_s": None, "logits_s": None, "calls": 0,
                "modal_tokens": None, "modal_calls": 0, "total_s": total, "rounds": None}
    if len(tokens) != len(forward):
        tokens = [-1.0] * len(forward)
    counts: dict[float, int] = {}
    for n in tokens:
        counts[n] = counts.get(n, 0) + 1
    # Most frequent token count; on a tie the smaller one (decode-shaped).
    mode = min(counts, key=lambda n: (-counts[n], n))
    chosen = [d for d, n in zip(forward, tokens) if n == mode]
    t_forward = statistics.median(chosen)
    t_logits = statistics.median(logits) if logits else 0.0
    rounds = [int(r) for r in (record or {}).get("rounds") or []]
    return {
        "torch_threads": [int(t) for t in (record or {}).get("torch_threads") or []],
        "rounds": rounds[0] if rounds else None,
        "seconds": t_forward + t_logits,
        "forward_s": t_forward,
        "logits_s": t_logits,
        "calls": len(forward),
        "modal_tokens": int(mode),
        "modal_calls": len(chosen),
        "total_s": total,
    }


def model_time_speedup(
    baseline_model_s: float | None,
    baseline_tokens: int,
    model_s: float | None,
    tokens: int,
) -> float | None:
    """Measured model time per generated token of the baseline over a configuration's
    (target + draft forward and logits seconds): the speed-up with engine overhead
    (scheduling, sampling, CPU-side proposing) left out. None without timings."""
    if not baseline_model_s or not model_s or baseline_tokens <= 0 or tokens <= 0:
        return None
    return (baseline_model_s / baseline_tokens) / (model_s / tokens)


def counter_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """after - before for scalar counters and element-wise for per-position vectors."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        prev = before.get(key)
        if isinstance(value, list):
            prev_list = prev if isinstance(prev, list) else []
            out[key] = [
                v - (prev_list[i] if i < len(prev_list) else 0) for i, v in enumerate(value)
            ]
        elif isinstance(value, (int, float)):
            out[key] = value - (prev if isinstance(prev, (int, float)) else 0)
    return out


def subtract_stats(
    before: Mapping[str, Any] | None, after: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Numeric ``after - before`` of two drafter-stat snapshots (warm-up excluded)."""
    if after is None:
        return None
    before = before or {}
    return {
        k: (v - before.get(k, 0) if isinstance(v, (int, float)) else v)
        for k, v in after.items()
    }
