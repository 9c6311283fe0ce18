"""Per-step draft lengths from measured costs and each request's acceptance (issue 32).

A speculative step with ``B`` requests, request ``r`` drafting ``L_r`` tokens, emits in
expectation ``E(L) = sum_r (1 + sum_{i<=L_r} g_{r,i})`` tokens, where
``g_{r,i} = prod_{j<=i} a_{r,j}`` is the probability that draft tokens ``1..i`` are all
accepted (``a_{r,j}``: the conditional acceptance of position ``j`` given ``1..j-1``
accepted). It costs (:class:`StepCosts`)::

    C(L) = fixed + target(B, S) + [S > 0] round + sum_{d=1}^{M-1} (pass + row * #{r: L_r > d})

with ``S = sum_r L_r`` (the verification rows the drafts add to the target's forward),
``M = max_r L_r`` and one lookahead draft pass per depth over the requests still drafting
(the chain round of ``glue/chain_drafter.py``: token 1 comes from the first pass, which
runs in any case, so it costs the drafter nothing more; token ``i >= 2`` costs a row of
pass ``i - 1``; in MTAD's beam round a request carries its ``w_r`` beams in every pass it
takes part in, ``row * sum_{r: L_r > d} w_r``). :func:`choose_draft_lengths` maximises
``E(L) / C(L)``, expected tokens per second, over ``0 <= L_r <= cap_r``: ``L = 0``
everywhere is a plain decode step.

The maximisation is exact (a brute-force search over every length vector in the tests
agrees) for any ``target(B, S)`` and draft passes linear in their rows:

* Dinkelbach: ``max E/C`` is the ``lambda`` where ``max_L E(L) - lambda C(L) = 0``;
  iterating ``lambda <- E(L*)/C(L*)`` from any feasible ``L`` converges in a few steps
  (finitely many ``L``).
* For one ``lambda`` and an upper bound ``M`` on the lengths (its ``M - 1`` pass costs
  paid), the rest is separable with per-token values ``v_{r,i} = g_{r,i} - lambda * row *
  [i >= 2]``, non-increasing in ``i`` (``g`` is a running product of numbers in
  ``[0, 1]``), so the best ``S`` tokens are the ``S`` largest values (ties: lower ``i``
  first), which form a prefix of every request. All ``(M, S)`` are scanned at once with
  cumulative sums; an ``M`` above the true maximum only overstates the cost, so the
  maximum over ``M`` is the true maximum.

:class:`CostStop` is the same decision online, inside a round (the shape of
:class:`~.draft_stop.DraftStopRule`, no host sync per pass): a request goes on drafting
while the expected gain of its next token, ``P(all drafted so far accepted) * a_next``,
pays for that token's marginal cost at the step's rate, ``lambda * (token + row)``, and
never past its planned length. ``P(...)`` is read online from the draft's confidence
(or the acceptance head), as SpecDec++ does; its threshold is a cost ratio, as SpecDec++'s
analysis says it should be, here measured rather than fixed. A confidence is read through
:class:`ConfidenceCalibration`, the acceptance measured at that confidence, since a draft's
confidence is not its acceptance probability.

:class:`AcceptanceHistory` keeps each request's per-position acceptance (counts that decay,
shrunk toward the pooled rate of all requests) and says which requests are due a probe
(a request planned at zero learns nothing, so now and then it drafts one token).

Pure PyTorch / NumPy, no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_specx.algorithms.draft_stop import DraftStopRule, confidence_signal


@dataclass(frozen=True)
class StepCosts:
    """Seconds (or any one unit: only ratios matter) of one speculative step.

    ``target(B, S) = target_base + target_per_request * B + target_per_token * S``: the
    target step with ``B`` requests verifying ``S`` draft tokens in all (its own ``B``
    tokens included in the per-request term). ``fixed``: the rest of the step that does
    not depend on the lengths (the drafter's first pass). ``draft_round``: paid when any
    request drafts (the first token's logits and draw; a step where nobody drafts skips
    them). A lookahead pass over ``n`` rows costs ``draft_pass + draft_row * n``.
    ``verify_fixed``: the part of ``draft_round`` the target side pays for verifying any
    draft at all (the verification path); a chain pays it exactly when somebody drafts,
    but a drafted tree pruned to nothing does not (``tree_budget.step_costs_paid``).
    ``skip_debt``: per request, what a step where nobody drafts leaves to be paid later
    (a drafter that skips its first pass then catches the draft KV of that position up in
    a later pass): skipping the first pass saves ``draft_round`` less this, per request.
    """

    target_base: float
    target_per_request: float
    target_per_token: float
    draft_pass: float
    draft_row: float
    fixed: float = 0.0
    draft_round: float = 0.0
    verify_fixed: float = 0.0
    skip_debt: float = 0.0

    def target(self, num_reqs: int, draft_tokens: np.ndarray | int) -> np.ndarray | float:
        return (self.target_base + self.target_per_request * num_reqs
                + self.target_per_token * draft_tokens)

    def step_time(self, lengths: Sequence[int],
                  widths: Sequence[int] | np.ndarray | None = None) -> float:
        """``C(L)`` of the module doc, by its definition (the reference the tests use).
        ``widths[r]`` (default 1): the rows request ``r`` carries in each lookahead pass it
        takes part in (a beam round, ``mtad``: its live beams; only the chosen beam is
        verified, so its verification rows stay one per drafted token)."""
        lengths = [int(n) for n in lengths]
        w = [1.0] * len(lengths) if widths is None else [float(x) for x in np.broadcast_to(
            np.asarray(widths), (len(lengths),))]
        total = self.fixed + float(self.target(len(lengths), sum(lengths)))
        if any(lengths):
            total += self.draft_round
        else:
            total += self.skip_debt * len(lengths)
        for depth in range(1, max(lengths, default=0)):
            rows = sum(wr for n, wr in zip(lengths, w) if n > depth)
            total += self.draft_pass + self.draft_row * rows
        return total


def expected_gains(accept_rates: torch.Tensor | np.ndarray) -> np.ndarray:
    """``g[r, i] = prod_{j<=i} a[r, j]`` from conditional acceptance rates ``[R, K]``."""
    a = np.clip(np.asarray(accept_rates, dtype=np.float64), 0.0, 1.0)
    return np.cumprod(a, axis=1)


def expected_tokens(gains: np.ndarray, lengths: Sequence[int]) -> float:
    """``E(L)``: one token per request plus the accepted-prefix probabilities drafted."""
    n = np.asarray(lengths, dtype=np.int64)
    drafted = np.arange(gains.shape[1])[None, :] < n[:, None]
    return float(len(n) + (gains * drafted).sum())


@dataclass(frozen=True)
class LengthChoice:
    lengths: np.ndarray  # [R] int64
    rate: float  # E(L) / C(L): expected tokens per unit of time
    expected_tokens: float
    step_time: float


def _best_for_lambda(
    gains: np.ndarray, caps: np.ndarray, costs: StepCosts, lam: float,
    widths: np.ndarray | None = None,
) -> np.ndarray:
    """``argmax_L E(L) - lam * C(L)`` (see the module doc)."""
    num_reqs, k = gains.shape
    cols = np.broadcast_to(np.arange(k), (num_reqs, k))
    allowed = cols < caps[:, None]
    # Token i >= 2 of request r costs its widths[r] rows of lookahead pass i - 1: still a
    # constant per request from i = 2 on, so the values stay non-increasing in i.
    row = costs.draft_row if widths is None else costs.draft_row * widths[:, None]
    values = gains - lam * row * (cols >= 1)
    rows = np.broadcast_to(np.arange(num_reqs)[:, None], (num_reqs, k))
    v, c, r = values[allowed], cols[allowed], rows[allowed]
    best = np.zeros(num_reqs, dtype=np.int64)
    if v.size == 0:
        return best
    order = np.lexsort((c, -v))  # largest value first; ties: the shallower token first
    v, c, r = v[order], c[order], r[order]
    max_m = int(c.max()) + 1
    m = np.arange(1, max_m + 1)[:, None]  # candidate maximum lengths
    in_m = c[None, :] < m  # [M, n]
    gain = np.cumsum(np.where(in_m, v[None, :], 0.0), axis=1)
    count = np.cumsum(in_m, axis=1)
    cost = costs.target(num_reqs, count) + costs.draft_pass * (m - 1) + costs.draft_round
    objective = np.where(in_m, gain - lam * cost, -np.inf)
    # S = 0: nobody drafts (and the skipped first pass is caught up later)
    zero = -lam * (float(costs.target(num_reqs, 0)) + costs.skip_debt * num_reqs)
    mi, j = np.unravel_index(int(np.argmax(objective)), objective.shape)
    if objective[mi, j] <= zero:
        return best
    chosen = in_m[mi, : j + 1]
    np.add.at(best, r[: j + 1][chosen], 1)
    return best


def choose_draft_lengths(
    gains: np.ndarray | torch.Tensor,
    costs: StepCosts,
    caps: Sequence[int] | np.ndarray | None = None,
    max_iterations: int = 32,
    widths: Sequence[int] | np.ndarray | int | None = None,
    min_gain: float = 0.0,
) -> LengthChoice:
    """Each request's draft length maximising expected tokens per second of the step.

    ``gains[r, i]``: probability that draft tokens ``1..i+1`` of request ``r`` are all
    accepted (:func:`expected_gains`); ``caps[r]``: the most it may draft (default ``K``,
    the width of ``gains``; 0: it drafts nothing). ``widths[r]`` (default 1): the rows
    request ``r`` carries in every lookahead pass it takes part in: a chain 1, MTAD's beam
    search its ``B`` beams (1 for a greedy request drafting the argmax chain). Each request
    of a beam round runs to its own depth and leaves the later passes
    (``beam_draft.beam_search_batched``'s ``row_depth``), so its cost is the chain's with
    ``widths[r]`` rows per pass (:meth:`StepCosts.step_time`) and the same exact search
    applies. ``min_gain``: the best plan is kept only if its rate beats the plain step's
    by more than that fraction; otherwise nobody drafts."""
    g = np.asarray(gains, dtype=np.float64)
    num_reqs, k = g.shape
    cap = np.full(num_reqs, k, dtype=np.int64) if caps is None else np.minimum(
        np.asarray(caps, dtype=np.int64), k)
    w = None if widths is None else np.broadcast_to(
        np.asarray(widths, dtype=np.float64), (num_reqs,))
    if num_reqs == 1:
        return _choose_one_length(g[0], int(cap[0]), costs,
                                  1.0 if w is None else float(w[0]), min_gain)
    lengths = np.zeros(num_reqs, dtype=np.int64)
    plain = costs.step_time(lengths, w)
    if not (plain > 0.0 and np.isfinite(plain)):
        # No rate without a positive step time: a plain step (nobody drafts) is always
        # safe, and an engine must not die of a cost model's fault.
        return LengthChoice(lengths, 0.0, expected_tokens(g, lengths), plain)
    rate = expected_tokens(g, lengths) / plain
    for _ in range(max_iterations):
        candidate = _best_for_lambda(g, cap, costs, rate, w)
        cand_time = costs.step_time(candidate, w)
        if not cand_time > 0.0:
            break
        cand_rate = expected_tokens(g, candidate) / cand_time
        if not cand_rate > rate * (1.0 + 1e-12):
            break
        lengths, rate = candidate, cand_rate
    plain_rate = num_reqs / plain
    if lengths.any() and not rate > plain_rate * (1.0 + min_gain):
        lengths, rate = np.zeros(num_reqs, dtype=np.int64), plain_rate
    return LengthChoice(lengths, rate, expected_tokens(g, lengths),
                        costs.step_time(lengths, w))


def _choose_one_length(gains: np.ndarray, cap: int, costs: StepCosts, width: float,
                       min_gain: float) -> LengthChoice:
    """:func:`choose_draft_lengths` for one request: every length ``0..cap`` priced by
    the module doc's formulas, the best rate ``E(L) / C(L)`` kept (ties: the shorter).
    Batch 1 is every step of a single-user server, where the general search's array
    set-up cost more than the search itself; a few floats in a loop cost ~5 us."""
    base = costs.fixed + costs.target_base + costs.target_per_request
    per_pass = costs.draft_pass + costs.draft_row * width
    tokens, time = 1.0, base + costs.skip_debt
    if not (time > 0.0 and np.isfinite(time)):
        # As the general search: no rate without a positive plain step time.
        return LengthChoice(np.zeros(1, dtype=np.int64), 0.0, tokens, time)
    plain = best = (0, tokens / time, tokens, time)
    best_rate = plain_rate = plain[1]
    for n, g in enumerate(gains[:cap].tolist(), start=1):
        tokens += g
        time = (base + costs.target_per_token * n + costs.draft_round
                + (n - 1) * per_pass)
        rate = tokens / time if time > 0.0 else 0.0
        if rate > best_rate:
            best_rate, best = rate, (n, rate, tokens, time)
    if best[0] > 0 and not best_rate > plain_rate * (1.0 + min_gain):
        best = plain
    n, rate, tokens, time = best
    return LengthChoice(np.array([n], dtype=np.int64), float(rate), float(tokens),
                        float(time))


class AcceptanceHistory:
    """Per-request conditional acceptance per draft position, from the request's own
    verified drafts (counts that decay by ``decay`` per observation so a request's rate
    follows its text), shrunk toward the pooled rate of all requests with weight
    ``request_weight`` (a new request starts at the pooled rate). The pooled rate starts at
    ``prior`` (weight ``prior_weight``).

    Why a request's own counts are kept longer and shrunk harder than a first guess would
    (``decay`` 0.97: about its last 33 verified drafts; ``request_weight`` 12): a draft's
    acceptance near the break-even is noise from step to step, and the plan stops a request
    whose estimate falls below it. With a 10-draft window and weight 2, a few rejections in
    a row did that where drafting paid (real pair, batch 1, T = 0, ``adaptive``: pooled
    first-position acceptance 0.178 against a break-even of 0.117, yet nothing drafted on
    183 of 298 steps, 0.97x of no speculation where drafting every step ran 1.06x; on an
    H200 ``specx_eagle3`` drafted on 38 of 624 steps). At 0.178 the estimate's standard
    deviation was about 0.07 and is now about 0.034: it crosses a break-even 0.06 below on
    a few percent of steps rather than a fifth. A request that never accepts still ends at
    about a quarter of the pooled rate.

    The weight rises above ``request_weight`` (up to ``max_request_weight``) when the
    requests' first-position counts vary no more than their sampling noise would
    (:meth:`request_weight_now`, a method-of-moments estimate of how much the requests'
    true rates differ, over the rows with a few drafts each): then a request's own run of
    luck says nothing about its next draft, and chasing it drafted at a loss (real pair,
    batch 1, T = 1, ``adaptive``: pooled first-position acceptance 0.17 against a
    break-even of about 0.23, yet a third of the steps drafted, 0.92x of no speculation).
    Where the requests do differ (code and prose at T = 0) it stays at ``request_weight``.

    Probes back off: a request planned at zero probes one token after ``probe_interval``
    idle steps; each probe the target rejects doubles that request's interval (up to
    ``2 ** max_probe_backoff`` times), and an accepted probe, or a plan that drafts for
    the request on its own account, resets it. Why: at batch 1, where one certainly
    accepted token always pays, a request whose drafts did not pay probed every 16 steps
    for its whole life, and each probe also kept its draft KV upkeep going (the catch-ups,
    and never reaching ``DraftKVHoles.retire_after``). With the back-off, a request whose
    probes keep failing goes idle long enough to retire: real pair, batch 1, T = 1,
    ``adaptive`` over 4 x 256 tokens (first-position acceptance about 0.17 against a
    break-even near 0.23), the drafter's CPU outside the target's forward went from 3.8 to
    1.8 ms per token over no speculation, 11 of 16 requests retiring (docs/cost-control.md,
    "Probes that back off").

    Requests live in rows of two ``[slots, K]`` count arrays (one row per request id), so
    a step's updates and reads are a few array operations whatever the batch size."""

    # Rows (requests) with at least this many decayed first-position tries, and how many
    # such rows, before their spread is read (fewer: ``request_weight``).
    DISPERSION_MIN_TRIES = 3.0
    DISPERSION_MIN_REQUESTS = 4

    def __init__(self, k_max: int, prior: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.97, pooled_decay: float = 0.99,
                 probe_interval: int = 16, request_weight: float = 12.0,
                 max_request_weight: float = 200.0, max_probe_backoff: int = 2) -> None:
        self.k_max = k_max
        self.prior = prior
        self.prior_weight = prior_weight
        self.request_weight = request_weight
        self.max_request_weight = max(max_request_weight, request_weight)
        self._weight = request_weight  # request_weight_now(), refreshed by observe_many
        self.decay = decay
        self.pooled_decay = pooled_decay
        self.probe_interval = probe_interval
        self.max_probe_backoff = max_probe_backoff
        self.pooled_tried = np.zeros(k_max)
        self.pooled_accepted = np.zeros(k_max)
        self._slot: dict[str, int] = {}
        self._tried = np.zeros((0, k_max))
        self._accepted = np.zeros((0, k_max))
        self._idle = np.zeros(0, dtype=np.int64)  # steps since the request last drafted
        # Failed probes in a row (the interval's doubling), and whether the request's last
        # draft was a probe not yet verified.
        self._backoff = np.zeros(0, dtype=np.int64)
        self._probing = np.zeros(0, dtype=bool)

    def _slots(self, req_ids: Sequence[str]) -> np.ndarray:
        """Each request's row, a fresh zero row (no evidence) for a new one."""
        slots = np.empty(len(req_ids), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._slot[rid] = len(self._slot)
            slots[i] = slot
        grow = len(self._slot) - self._tried.shape[0]
        if grow > 0:
            grow = max(grow, self._tried.shape[0])  # amortised doubling
            self._tried = np.concatenate([self._tried, np.zeros((grow, self.k_max))])
            self._accepted = np.concatenate([self._accepted, np.zeros((grow, self.k_max))])
            self._idle = np.concatenate([self._idle, np.zeros(grow, dtype=np.int64)])
            self._backoff = np.concatenate([self._backoff, np.zeros(grow, dtype=np.int64)])
            self._probing = np.concatenate([self._probing, np.zeros(grow, dtype=bool)])
        return slots

    def observe_many(self, req_ids: Sequence[str], drafted: Sequence[int],
                     accepted: Sequence[int]) -> None:
        """Request ``req_ids[i]`` had ``drafted[i]`` tokens verified, ``accepted[i]`` of them
        taken: positions ``1..min(accepted + 1, drafted)`` were tried, ``1..accepted``
        passed. Requests with nothing drafted are skipped."""
        d = np.minimum(np.asarray(drafted, dtype=np.int64), self.k_max)
        keep = d > 0
        if not keep.any():
            return
        d = d[keep]
        a = np.clip(np.asarray(accepted, dtype=np.int64)[keep], 0, d)
        ids = [rid for rid, k in zip(req_ids, keep) if k]
        cols = np.arange(self.k_max)
        tried = (cols[None, :] < np.minimum(a + 1, d)[:, None]).astype(np.float64)
        passed = (cols[None, :] < a[:, None]).astype(np.float64)
        slots = self._slots(ids)
        # A verified probe: rejected, the request's next probe waits twice as long;
        # accepted, the usual interval again.
        probed = self._probing[slots]
        if probed.any():
            ps = slots[probed]
            self._backoff[ps] = np.where(a[probed] > 0, 0, np.minimum(
                self._backoff[ps] + 1, self.max_probe_backoff))
            self._probing[ps] = False
        self._tried[slots] = self._tried[slots] * self.decay + tried
        self._accepted[slots] = self._accepted[slots] * self.decay + passed
        decay_all = self.pooled_decay ** len(ids)
        self.pooled_tried = self.pooled_tried * decay_all + tried.sum(0)
        self.pooled_accepted = self.pooled_accepted * decay_all + passed.sum(0)
        self._weight = self.request_weight_now()

    def request_weight_now(self) -> float:
        """The pooled rate's weight against a request's own counts: ``request_weight``,
        or more when the requests' first-position rates differ by no more than noise.

        Method of moments on the rows with ``DISPERSION_MIN_TRIES`` decayed tries or more
        (``n_i`` tries, rate ``r_i``, overall rate ``p``): the between-request variance is
        ``tau2 = (sum n_i (r_i - p)^2 - (R - 1) p (1 - p)) / (N - sum n_i^2 / N)``, and a
        beta prior of that variance around ``p`` weighs ``p (1 - p) / tau2 - 1`` tries;
        clipped to ``[request_weight, max_request_weight]`` (``tau2 <= 0``: the maximum)."""
        rows = len(self._slot)
        n, a = self._tried[:rows, 0], self._accepted[:rows, 0]
        use = n >= self.DISPERSION_MIN_TRIES
        if int(use.sum()) < self.DISPERSION_MIN_REQUESTS:
            return self.request_weight
        n, a = n[use], a[use]
        total = float(n.sum())
        p = float(a.sum()) / total
        if not 0.0 < p < 1.0:
            return self.max_request_weight
        spread = float((n * (a / n - p) ** 2).sum()) - (len(n) - 1) * p * (1.0 - p)
        tau2 = spread / (total - float((n * n).sum()) / total)
        if tau2 <= 0.0:
            return self.max_request_weight
        weight = p * (1.0 - p) / tau2 - 1.0
        return float(min(max(weight, self.request_weight), self.max_request_weight))

    def observe(self, req_id: str, drafted: int, accepted: int) -> None:
        """:meth:`observe_many` for one request."""
        self.observe_many([req_id], [drafted], [accepted])

    def pooled_rates(self) -> np.ndarray:
        """Pooled conditional acceptance per position, ``[K]``: position 1 shrunk toward
        ``prior``, each later position toward the larger of ``prior`` and the position
        before it (weight ``prior_weight``). A position no request has reached yet is
        optimistic, never below ``prior``: the conditional acceptance of a deeper draft
        token (given the ones before it accepted) is usually higher than the first's
        (real pair, EAGLE-3 head: about 0.33 at position 1 and 0.6 after it), and a rate
        copied from a weak position 1 priced position 2 so low that no plan drafted it and
        nothing ever measured it (the plan stuck at one token at batch 1: 1.09x of no
        speculation where the stop rule alone ran at 1.21x). A few tries pull a position
        that really is weak down to its data."""
        w = self.prior_weight
        out = np.empty(self.k_max)
        anchor = self.prior
        for i in range(self.k_max):
            rate = (self.pooled_accepted[i] + w * anchor) / (self.pooled_tried[i] + w)
            out[i] = rate
            anchor = max(rate, self.prior)
        return out

    def rates(self, req_ids: Sequence[str]) -> np.ndarray:
        """``[R, K]`` conditional acceptance per position for each request."""
        pooled = self.pooled_rates()
        slots = self._slots(req_ids)
        w = self._weight
        return (self._accepted[slots] + w * pooled) / (self._tried[slots] + w)

    def probes(self, req_ids: Sequence[str], lengths: np.ndarray,
               may_probe: bool | np.ndarray = True) -> np.ndarray:
        """``lengths`` with a one-token draft for every request that has drafted nothing for
        its probe interval (``probe_interval`` steps, doubled per rejected probe in a row:
        see the class doc) and drafts nothing now, and ``may_probe`` (per request, or for
        all): without it a request planned at zero would never learn that its drafts
        became good. A request due but not allowed stays due and probes at the first step
        that allows it. Updates the idle counters; a request the plan drafts for starts
        its next idle run at the usual interval. A request planned at zero forgets a
        little of its own history (``decay`` per step), so its estimate drifts back toward
        the pooled rate while it does not draft instead of staying at the few rejections
        that stopped it."""
        out = np.asarray(lengths, dtype=np.int64).copy()
        slots = self._slots(req_ids)
        zero = out == 0
        idle_slots = slots[zero]
        self._tried[idle_slots] *= self.decay
        self._accepted[idle_slots] *= self.decay
        self._backoff[slots[~zero]] = 0
        idle = np.where(zero, self._idle[slots] + 1, 0)
        probe = (idle >= self._intervals(slots)) & np.broadcast_to(
            np.asarray(may_probe, dtype=bool), idle.shape)
        out[probe] = 1
        self._probing[slots[probe]] = True
        self._idle[slots] = np.where(probe, 0, idle)
        return out

    def probe_intervals(self, req_ids: Sequence[str]) -> np.ndarray:
        """Each request's current probe interval, in idle steps (``[R]``)."""
        return self._intervals(self._slots(req_ids))

    def _intervals(self, slots: np.ndarray) -> np.ndarray:
        return self.probe_interval * (1 << self._backoff[slots])

    def forget_except(self, req_ids: Sequence[str]) -> None:
        """Drop every request not in ``req_ids`` (finished or preempted ones)."""
        keep = [rid for rid in dict.fromkeys(req_ids) if rid in self._slot]
        old = np.array([self._slot[rid] for rid in keep], dtype=np.int64)
        self._tried, self._accepted = self._tried[old], self._accepted[old]
        self._idle = self._idle[old]
        self._backoff, self._probing = self._backoff[old], self._probing[old]
        self._slot = {rid: i for i, rid in enumerate(keep)}


# Inner bin edges of :class:`ConfidenceCalibration` (confidence signals live in [0, 1]):
# finer near 1, where a confident draft's acceptance decides how deep a round goes.
CALIBRATION_EDGES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


class ConfidenceCalibration:
    """``P(a draft token is accepted | the draft's confidence in it)``, learnt online.

    A draft's confidence (its probability of the token it drew, or another confidence
    signal) is not the probability that the target accepts the token: a small draft that
    agrees with its target nearly always may still spread its probability (seen on the MTP
    fixture: acceptance 0.99 at confidences around 0.3-0.5), and an over-confident one the
    other way. :class:`CostStop` prices the next token with ``P(Y_1..Y_j accepted)``, so it
    reads each confidence through this table instead of at face value.

    Counts per confidence bin (``edges``, inner edges in ``(0, 1)``): a verified token adds
    one try to its bin, and one acceptance if the target accepted it. Token ``i`` (0-based)
    of a request that had ``n`` of its draft tokens accepted was verified iff ``i <= n``
    (tokens past the first rejection were never judged). Counts decay by ``decay`` per
    observed step (the rate follows the text); the table is
    ``(accepted + w * c_mid) / (tried + w)``, shrunk toward the confidence itself (the
    bin's midpoint ``c_mid``, weight ``w = prior_weight``), so an unseen bin is read at
    face value, as before any calibration.
    """

    def __init__(self, edges: Sequence[float] = CALIBRATION_EDGES, prior_weight: float = 4.0,
                 decay: float = 0.98) -> None:
        self.edges = np.asarray(edges, dtype=np.float64)
        if self.edges.ndim != 1 or np.any(np.diff(self.edges) <= 0) or (
                self.edges.size and (self.edges[0] <= 0 or self.edges[-1] >= 1)):
            raise ValueError(f"calibration edges must increase strictly inside (0, 1): {edges}")
        bounds = np.concatenate([[0.0], self.edges, [1.0]])
        self.prior = (bounds[:-1] + bounds[1:]) / 2
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.tried = np.zeros(self.prior.size)
        self.accepted = np.zeros(self.prior.size)

    def bins(self, confidences: np.ndarray) -> np.ndarray:
        """Each confidence's bin: ``edges[b - 1] < c <= edges[b]`` (``torch.bucketize``'s
        rule, in float32 as on the device, so the host and the device agree)."""
        return np.searchsorted(self.edges.astype(np.float32),
                               np.asarray(confidences, dtype=np.float32), side="left")

    def table(self) -> np.ndarray:
        """``P(accepted | bin)`` per bin, float64 ``[len(edges) + 1]``."""
        w = self.prior_weight
        return (self.accepted + w * self.prior) / (self.tried + w)

    def observe(self, confidences: Sequence[Sequence[float] | None],
                accepted: Sequence[int]) -> None:
        """One verified step: per request, its draft tokens' confidences (NaN where the
        round did not read one; None: nothing known) and how many of them were accepted."""
        self.tried *= self.decay
        self.accepted *= self.decay
        # Every request's judged tokens in one flat array, counted in one pass per table
        # (a loop over the requests cost ~25 us each, every drafting step).
        judged_confs: list[float] = []
        hits: list[bool] = []
        for confs, n in zip(confidences, accepted):
            if not confs:
                continue
            n = int(n)
            head = list(confs[: n + 1])
            judged_confs += head
            hits += [i < n for i in range(len(head))]
        if not judged_confs:
            return
        c = np.asarray(judged_confs, dtype=np.float64)
        judged = ~np.isnan(c)
        b = self.bins(c[judged])
        size = self.prior.size
        self.tried += np.bincount(b, minlength=size)
        self.accepted += np.bincount(b, weights=np.asarray(hits, dtype=np.float64)[judged],
                                     minlength=size)

    def device_table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(edges, table)`` as float32 tensors on ``device``, for :class:`CostStop`."""
        return (torch.as_tensor(self.edges, dtype=torch.float32, device=device),
                torch.as_tensor(self.table(), dtype=torch.float32, device=device))


# Probabilities are floored here before their logs are taken (a zero would give -inf).
_TINY = 1e-12


class CostStop:
    """A :class:`~.draft_stop.DraftStopRule`: the planned lengths and the cost threshold,
    over another rule (the method's own stop, which may stop a request earlier).

    Request ``r`` goes on after ``Y_{j+1}`` iff ``j + 1 < caps[r]``, the inner rule keeps
    it, and ``P_r * a[r, j+1] >= threshold``: ``P_r`` is the estimated probability that
    ``Y_1..Y_{j+1}`` are all accepted (the product over its tokens of the draft's
    confidence when ``signal`` is a confidence signal, each read through ``calibration``
    (:class:`ConfidenceCalibration`'s ``device_table``) when given; the acceptance head's
    ``P(accept)`` of ``Y_1..Y_j`` times ``a[r, j]`` when ``signal == "head"``; the planned
    rates when ``signal == "history"``), ``a[r, j+1]`` the history's rate of the next
    position and ``threshold = lambda * (token + row)`` the next token's marginal cost at
    the step's rate. ``caps`` may be 0: the round then drops ``Y_1`` (:attr:`row_caps`).

    The next lookahead pass is shared: ``pass_threshold = lambda * pass`` is its cost at the
    step's rate, paid once by the rows that go on. It runs iff the live rows' positive
    margins ``P_r * a[r, j+1] - threshold`` add up to at least ``pass_threshold``, and then
    every row with a margin of at least 0 goes on (each adds no less than it costs). So a
    round decides its depth online, from the confidence of the drafts it has drawn, at the
    same costs the plan used: at batch 1 a confident draft goes deeper than the plan's
    length from acceptance alone, a doubtful one stops earlier.

    The state is ``[R, 3 + 2K]``: the inner rule's state, ``log P_r``, the cap, the rates'
    logs and the raw confidence read at each depth (NaN where none was), so the round's
    slicing by its live rows carries each row's own plan along, and the round can hand the
    confidences back (:meth:`confidences`) for the calibration to learn from. The logs of
    the rates and of the calibration table are taken once, when the rule is made: a step
    runs once per depth of every drafting round, and on a launch-bound device each of its
    tensor operations is a kernel.
    """

    def __init__(
        self,
        inner: DraftStopRule,
        caps: torch.Tensor,
        rates: torch.Tensor,
        threshold: float,
        signal: str = "token_prob",
        head: torch.nn.Module | None = None,
        calibration: tuple[torch.Tensor, torch.Tensor] | None = None,
        pass_threshold: float = 0.0,
    ) -> None:
        self.inner = inner
        self.row_caps = caps.to(torch.int64)  # [R]
        self.rates = rates.to(torch.float32)  # [R, K]
        self.threshold = float(threshold)
        self.pass_threshold = float(pass_threshold)
        self.signal = signal
        self.head = head
        self.calibration = calibration
        self._log_threshold = float(np.log(max(self.threshold, _TINY)))
        self._log_table = (None if calibration is None
                           else calibration[1].float().clamp_min(_TINY).log())
        # Whether step() reads a confidence per token (what confidences() returns).
        self.reads_confidence = signal not in ("head", "history")
        self.min_tokens = 1
        self.max_tokens = inner.max_tokens
        self.needs_hidden = inner.needs_hidden or signal == "head"
        self.needs_probs = inner.needs_probs or signal in ("max_prob", "top2_margin")

    def start(self, num_rows: int, device: torch.device) -> torch.Tensor:
        inner = self.inner.start(num_rows, device).to(torch.float32)
        return torch.cat([
            inner.view(num_rows, 1),
            torch.zeros(num_rows, 1, device=device),
            self.row_caps.to(device=device, dtype=torch.float32).view(num_rows, 1),
            self.rates.to(device).clamp_min(_TINY).log(),
            torch.full_like(self.rates, float("nan"), device=device),
        ], dim=1)

    def confidences(self, state: torch.Tensor) -> torch.Tensor:
        """``[R, K]``: the raw confidence step() read for each row's token ``j + 1`` at
        depth ``j`` (NaN where it read none: the row's last token, a head or history
        signal), for :meth:`ConfidenceCalibration.observe`."""
        return state[:, 3 + self.rates.shape[1]:]

    def step(
        self,
        state: torch.Tensor,
        depth: int,
        *,
        next_token_probs: torch.Tensor,
        next_probs: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inner_state, keep = self.inner.step(
            state[:, 0], depth, next_token_probs=next_token_probs, next_probs=next_probs,
            hidden=hidden)
        k = self.rates.shape[1]
        log_p, caps = state[:, 1], state[:, 2]
        log_rates = state[:, 3:3 + k]
        new_state = state.clone()
        if self.signal == "head":
            if depth >= 1 and hidden is not None and self.head is not None:
                with torch.no_grad():
                    log_p = log_p + self.head.accept_prob(hidden).float().clamp_min(
                        _TINY).log()
            current = log_p + log_rates[:, min(depth, k - 1)]
        elif self.signal == "history":
            log_p = log_p + log_rates[:, min(depth, k - 1)]
            current = log_p
        else:
            conf = confidence_signal(self.signal, next_token_probs, next_probs).float()
            if depth < k:
                new_state[:, 3 + k + depth] = conf
            if self.calibration is not None:
                log_p = log_p + self._log_table[torch.bucketize(conf, self.calibration[0])]
            else:
                log_p = log_p + conf.clamp_min(_TINY).log()
            current = log_p
        score = current + log_rates[:, min(depth + 1, k - 1)]
        keep = keep.to(torch.bool) & (score >= self._log_threshold) & (caps > depth + 1)
        if self.pass_threshold > 0.0:
            # The rows that would go on must pay for the pass together (one device-side
            # sum: no host read beyond the keep mask the round reads anyway).
            margin = score.exp() - self.threshold
            total = torch.where(keep, margin.clamp_min(0.0), 0.0).sum()
            keep = keep & (total >= self.pass_threshold)
        new_state[:, 0] = inner_state
        new_state[:, 1] = log_p
        return new_state, keep
