"""Cost control for the chain-draft rounds (issue 32): the engine measures its own step
costs online, keeps each request's acceptance, and plans every step's draft lengths
(``algorithms/draft_length.py``) so that drafting happens only where it pays.

Measured, not configured (:class:`MeasuredCosts`), from the engine's own steps:

* the **target side** of a step: the time from the end of one drafting round to the
  start of the next (wall time on a GPU; on a CPU host the engine process's CPU time,
  :attr:`~vllm_specx.backends.base.Backend.cost_clock`, so that other jobs on a shared
  host do not read as the cost of drafting), i.e. scheduling, the target's forward over
  ``B`` requests verifying ``S`` draft tokens, sampling and bookkeeping, and, for a
  drafter that plans after its first pass (draft trees), that first pass. The chain
  drafters on V1 and Model Runner V2 (a draft model, and EAGLE / MTP heads, whose skipped
  pass ``glue/head_kv_holes.py`` catches up) start their round before their first pass
  instead (``plan_before_first_pass`` in ``glue/chain_drafter.py``, called from
  ``SpecxPasses.propose`` on V1 and ``plan_or_skip_first_pass`` in
  ``glue/v2_speculators.py`` on V2): a step where nobody drafts skips the pass, so the
  pass belongs to the round's ``any draft`` term. Fitted as
  ``a + b * B + c * S + d * [S > 0]`` over decode steps (``d``: verifying anything at all,
  priced with the round's ``any draft``; steps with prefill tokens are skipped, and an
  interval far above the typical step, such as the idle gap between two ``generate``
  calls or a step that compiled kernels, is dropped; catch-ups of skipped first passes
  are left out, :meth:`MeasuredCosts.exclude`);
* the **round**: its time on the same clock, fitted as ``always + round * [anyone drafts]
  + pass * passes + row * rows + hole * holes`` (passes: lookahead passes; rows: their
  request rows; holes: positions that skipped first passes left, fed in this round's first
  pass by a draft model on V1; ``always``: what a round costs whether or not anyone drafts,
  left out of the plan); a round far above its prior cost is clipped.

The target side's slopes (per request, per draft token, verifying anything) come from
how the steps vary *within* blocks of 16 consecutive steps, each block its own level, and
its level from the median of the last steps less their slopes' part
(:class:`_LevelAndSlopes`): the host's speed drifts over minutes by more than verifying a
draft costs, and where drafting comes and goes in runs a single constant read that drift
as a cost of drafting; the slopes are Huber-weighted, so that a stretch of slow host steps
that takes in one of the few steps verifying anything does not price verifying. The round
is least squares with forgetting (about the last 100 rounds), the slopes weighted least
squares over the last 40 blocks that saw the step's shape change (the older ones fading),
both solved with every cost non-negative (``_nonnegative_least_squares``; every
:data:`REFIT_EVERY` steps in an engine), over a prior (pseudo-observations next to
the origin with a small constant weight). The prior is relative (a verification
row costs 5% of a target step, a draft row 1%, ...) and takes its scale from the median
of the recent steps (the first three held until their median can be taken), so the
first steps are sane on any device and one odd step sets no price; only cost ratios
decide lengths. "Far above" is judged against that median too, not against the fit,
which the outlier would already have moved.
On CPU the round's clocks are exact; on a GPU the round synchronises with the host when it
returns its ragged drafts, so the round's end time is real.

Tests inject a fixed model (:attr:`CostControl.fixed_costs`) so lengths do not depend on
timing; greedy outputs never do.

No vLLM import: the round (``glue/chain_drafter.py``) calls :class:`CostControl`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_specx.algorithms.draft_length import (
    AcceptanceHistory,
    ConfidenceCalibration,
    CostStop,
    LengthChoice,
    StepCosts,
    choose_draft_lengths,
    expected_gains,
)
from vllm_specx.algorithms.draft_stop import ConfidenceStop, DraftStopRule, HeadStop

# Relative prior (units of one target base step): see the module doc.
PRIOR_TARGET = (1.0, 0.02, 0.05, 0.02)  # base, per request, per draft token, any verified
_PRIOR_TARGET = np.array(PRIOR_TARGET)
# always (the plan's own host work), anyone drafts, per lookahead pass, per row, per hole
# position its first pass fed (DraftKVHoles.first_pass_with_holes: a row of a pass that
# runs anyway)
PRIOR_ROUND = (0.01, 0.05, 0.08, 0.01, 0.005)
# A plan drafts only if the model expects it to beat a plain step's rate by more than
# this fraction: near the break-even the requests it picks are picked for estimates above
# their true rate. Real pair, batch 1, T = 1, `adaptive` (interleaved runs, 2026-11-26
# 16:18-16:48 UTC, docs/cost-control.md): 0.951x of no speculation without the margin,
# 0.974x with it.
MIN_PLAN_GAIN = 0.03
PRIOR_WEIGHT = 0.5  # pseudo-observations' total weight; never decays
FORGETTING = 0.99  # data weight kept per new observation (~100-step window)
# Outliers, judged against the typical step rather than the fit (which an outlier moves):
# a step's "unit" is its interval over its prior relative cost (x . PRIOR_TARGET), and
# the prior's scale is the median unit of the last RECENT_UNITS steps.
OUTLIER_FACTOR = 5.0  # an interval this many units above the median is not a step
ROUND_OUTLIER_FACTOR = 10.0  # a round is clipped at this many times its prior cost
RECENT_UNITS = 33
# The target fit's slopes come from the variation within blocks of this many consecutive
# intervals, each block its own level (_LevelAndSlopes): the host's drift over a block is
# small against what verifying a draft costs.
LEVEL_BLOCK = 16
BLOCK_FORGETTING = 0.95  # per block that saw z change: about its last 20 such blocks
SLOPE_BLOCKS = 40  # the blocks kept for the slopes (the oldest weighs 0.95^39 = 0.14)
# The slopes' robust fit (_LevelAndSlopes._robust_slopes): an interval whose residual is
# more than HUBER_CLIP noise deviations (at least MIN_NOISE_FRACTION of the median
# interval) weighs in inversely to it; HUBER_ITERATIONS reweightings from least squares.
HUBER_CLIP = 2.0
MIN_NOISE_FRACTION = 0.002
HUBER_ITERATIONS = 6
CATCH_UP_DECAY = 0.99  # the catch-ups' cost per position follows about the last 100
FIRST_STEPS = 3  # held until their median can tell an outlier among them
OUTLIERS_IN_A_ROW = 4  # this many in a row are not outliers: the steps changed
# A drafter's fits are solved every this many steps (a ~100-step window moves little in
# four): in a running engine each solve cost ~130 us of a batch-1 step's host time.
REFIT_EVERY = 4


def cost_control_applies(proposer: Any) -> bool:
    """Whether a drafter's measured cost control may run: its ``cost_control`` setting is
    on and it drafts on one rank. Under tensor or pipeline parallelism every rank runs the
    same draft passes in lockstep (collectives inside), and lengths or trees chosen from
    each rank's own clock could differ between ranks, so none are chosen."""
    if not proposer.settings.get("cost_control", False):
        return False
    parallel = getattr(getattr(proposer, "vllm_config", None), "parallel_config", None)
    return parallel is None or (
        parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1)


def retired_requests(proposer: Any) -> Container[str]:
    """Requests whose draft (or head) KV upkeep stopped (``DraftKVHoles.retired``): their
    drafts would read a KV with holes, so the chain control plans them nothing, none of
    their tree nodes is kept, and a batch of them drafts no tree depth."""
    holes = getattr(proposer, "_kv_holes", None)
    return holes.retired if holes is not None else ()


def cost_control_for(proposer: Any, k_max: int) -> CostControl | None:
    """The drafter's chain/depth cost control, made once on ``proposer._cost_control``
    (sized for the configured ``num_speculative_tokens`` or this step's ``k_max``,
    whichever is larger), or None where :func:`cost_control_applies` says no."""
    if not cost_control_applies(proposer):
        return None
    if proposer._cost_control is None:
        configured = proposer.settings.get("num_speculative_tokens") or k_max
        proposer._cost_control = CostControl(
            max(int(configured), k_max), clock=engine_step_clock(),
            # Requests whose draft KV upkeep stopped (DraftKVHoles.retired): never drafted.
            retired=lambda: retired_requests(proposer),
            refit_every=REFIT_EVERY)
    return proposer._cost_control


def engine_step_clock() -> Callable[[], float]:
    """The clock the cost model times steps with: the device backend's ``cost_clock``
    (wall time on a GPU, the process's CPU time on a CPU host)."""
    from vllm_specx.backends import select_backend  # reads vLLM's platform: lazy

    return select_backend().cost_clock


def cost_control_stats(proposer: Any, stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` (a drafter's ``DrafterStats`` dict for ``vllm-specx bench``) with the
    cost control's model and plans under ``"cost_control"`` where it ran, and the skipped
    first passes' catch-ups (``DraftKVHoles``) where the drafter has them; the chain
    drafters and mtad's depth control report alike."""
    control = getattr(proposer, "_cost_control", None)
    if control is not None:
        stats["cost_control"] = control.describe()
        holes = getattr(proposer, "_kv_holes", None)
        if holes is not None:
            stats["cost_control"]["idle_first_pass"] = holes.as_dict()
    return stats


def _is_nonnegative_optimum(a: np.ndarray, b: np.ndarray, theta: np.ndarray,
                            free: np.ndarray) -> bool:
    """Whether ``theta`` (solving the ``free`` coefficients' own equations, the rest 0)
    is the minimum over ``theta >= 0``: its free coefficients are not negative and the
    objective's gradient ``a theta - b`` does not fall along any coefficient held at 0
    (the Karush-Kuhn-Tucker conditions, sufficient here: ``a`` is positive definite)."""
    if (theta[free] < 0).any():
        return False
    gradient = a @ theta - b
    slack = 1e-9 * max(float(np.abs(b).max()), 1e-300)
    return bool((gradient[~free] >= -slack).all())


def _solve_free(a: np.ndarray, b: np.ndarray, free: np.ndarray) -> np.ndarray | None:
    """The minimum with the coefficients outside ``free`` held at 0 (None: singular)."""
    if free.all():
        try:
            return np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            return None
    theta = np.zeros(a.shape[0])
    if free.any():
        try:
            theta[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        except np.linalg.LinAlgError:
            return None
    return theta


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray,
                               free_hint: np.ndarray | None = None) -> np.ndarray:
    """``argmin_{theta >= 0} theta' a theta - 2 b' theta`` (least squares from its normal
    equations, costs not negative), exact: the minimum lies where the free coefficients
    solve their own equations with the rest at 0, so every subset of free coefficients is
    solved and the best non-negative solution kept (16 solves for 4 coefficients).

    Why not solve and clip each negative coefficient: two regressors that the steps
    barely tell apart (at batch 1 nearly every step verifies 0 or 1 draft token, where
    ``S`` and ``[S > 0]`` are the same column) get large opposite coefficients whose sum
    fits; clipping the negative one kept the other, and a verified token was priced at
    54 ms on a 75 ms step (the plan then drafted on 4% of steps).

    The fit runs after every step, and one step moves it little: ``free_hint`` (the last
    solution's non-zero coefficients) is tried first and kept where it passes the
    optimality conditions (:func:`_is_nonnegative_optimum`), one solve, then the
    unconstrained minimum; the subset search is the last resort. On an H200 at batch 1
    the search ran on nearly every step (its unconstrained fit had a negative
    coefficient) and the plan's fits cost about a tenth of a 14 ms decode step."""
    dims = a.shape[0]
    every = np.ones(dims, dtype=bool)
    for free in ((free_hint, every) if free_hint is not None and not free_hint.all()
                 else (every,)):
        theta = _solve_free(a, b, free)
        if theta is not None and _is_nonnegative_optimum(a, b, theta, free):
            return theta
    best, best_value = np.zeros(dims), 0.0  # all zero: the objective is 0
    for mask in range(1, 1 << dims):
        free = np.array([bool(mask >> i & 1) for i in range(dims)])
        sub = _solve_free(a, b, free)
        if sub is None or (sub < 0).any():
            continue
        value = -float(b @ sub)  # the objective at the free set's own minimum
        if value < best_value:
            best, best_value = sub, value
    return best


def _prior_sums(points: Sequence[tuple[np.ndarray, float]]) -> tuple[np.ndarray, np.ndarray]:
    """``sum w x x'`` and ``sum w x y`` of the prior's pseudo-points ``(x, y)``, their
    weights :data:`PRIOR_WEIGHT` in all (they never decay)."""
    w = PRIOR_WEIGHT / max(len(points), 1)
    return (sum(w * np.outer(x, x) for x, _ in points),
            sum(w * x * y for x, y in points))


class _CachedFit:
    """A fit whose coefficients are solved (``_solve``) at most every ``refit_every``
    observations (``count``) and read from the last solve in between; before any
    observation, the caller's fallback (the prior)."""

    count: int
    refit_every: int
    _solved_at: int
    _theta: np.ndarray | None

    def _solve(self, fallback: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def theta(self, fallback: np.ndarray) -> np.ndarray:
        if self.count == 0:
            return fallback  # nothing measured yet: the prior itself
        if self._theta is not None and self.count - self._solved_at < self.refit_every:
            return self._theta
        self._solved_at = self.count
        self._theta = self._solve(fallback)
        return self._theta


class _Regression(_CachedFit):
    """Least squares ``y ~ x . theta`` with forgetting over fixed prior pseudo-points."""

    def __init__(self, dims: int, refit_every: int = 1) -> None:
        self.dims = dims
        # Observations between two solves (1: every one). The plan reads the fit every
        # step, and in a running engine the solve cost ~130 us a regression where it
        # costs ~30 in a loop on its own (caches cold after the target's forward).
        self.refit_every = max(int(refit_every), 1)
        self._solved_at = 0
        self.prior_a = np.zeros((dims, dims))
        self.prior_b = np.zeros(dims)
        self.a = np.zeros((dims, dims))
        self.b = np.zeros(dims)
        self.count = 0
        # The last solution: a step reads theta up to three times (outlier check, plan)
        # between two observations; one solve each.
        self._theta: np.ndarray | None = None
        self._free: np.ndarray | None = None  # the last solution's non-zero coefficients
        self._ridge = 1e-12 * np.eye(dims)

    def set_prior(self, points: Sequence[tuple[np.ndarray, float]]) -> None:
        self.prior_a, self.prior_b = _prior_sums(points)
        self._theta = None

    def observe(self, x: np.ndarray, y: float) -> None:
        """One observation, after the data so far are weighed down by :data:`FORGETTING`."""
        self.a = FORGETTING * self.a + np.outer(x, x)
        self.b = FORGETTING * self.b + x * y
        self.count += 1

    def _solve(self, fallback: np.ndarray) -> np.ndarray:
        a = self.a + self.prior_a + self._ridge
        theta = _nonnegative_least_squares(a, self.b + self.prior_b, self._free)
        self._free = theta > 0
        return theta

    def predict(self, x: np.ndarray, fallback: np.ndarray) -> float:
        return float(x @ self.theta(fallback))


class _LevelAndSlopes(_CachedFit):
    """The target side's fit, ``y = level + z . slopes`` with ``z = [B, S, S > 0]``
    (:func:`_target_features` less its constant): the slopes from the variation of ``z``
    and ``y`` *within* blocks of :data:`LEVEL_BLOCK` consecutive intervals (each block its
    own level: a regression with a constant per block) over the last
    :data:`SLOPE_BLOCKS` blocks that saw ``z`` change, each weighed down by
    :data:`BLOCK_FORGETTING` per newer such block, robustly (:meth:`_robust_slopes`); the
    level from the median of the last :data:`RECENT_UNITS` intervals less their slopes'
    part. :meth:`theta` returns ``[level, *slopes]``, the shape of a four-term fit.

    Why blocks: the host's speed drifts over minutes, and a run where drafting stops and
    starts puts the steps that verify drafts in other minutes than those that do not.
    Fitted together (one constant), the drift read as a cost of verifying. On the real
    pair at batch 1 (T = 0, ``adaptive``, 2026-11-28) the target step moved between 45 and
    56 ms over a run, and a four-term fit with forgetting priced verifying one draft token
    at 0 to 4.6 ms as the regimes came and went, where steps next to each other differed
    by about 0.4 ms (median). Within a few steps the drift is nearly nothing, so only the
    change of ``z`` there prices a difference; a run of steps alike teaches nothing about
    the slopes and does not wear them away either. Blocks rather than pairs of consecutive
    steps: a block with one change of regime in it weighs all its steps on each side.

    Why robust: the host also slows for 1-20 steps at a time (on the real pair a CPU-time
    step of 43 ms took 50-105 ms), and where the plan is idle only its probes verify, one
    step in a block or fewer: a least squares over them followed whichever slow stretch took one
    in. The idle regime's fit priced verifying one token at 3.87 ms where, call by call,
    a verifying step cost about 1 ms more than its idle neighbours, and the plan stayed
    idle where drafting paid about 4% (docs/cost-control.md)."""

    def __init__(self, refit_every: int = 1) -> None:
        self.refit_every = max(int(refit_every), 1)
        self.count = 0
        self._block: list[tuple[np.ndarray, float]] = []
        # The blocks that saw z change, as ([LEVEL_BLOCK, 3] z, [LEVEL_BLOCK] y), oldest
        # first; how many came in so far, and at which count the slopes were last fitted.
        self._blocks: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=SLOPE_BLOCKS)
        self._blocks_seen = 0
        self._slopes_at = -1
        self._slopes: np.ndarray | None = None
        self._free: np.ndarray | None = None  # the last solution's non-zero slopes
        self._recent: deque[tuple[np.ndarray, float]] = deque(maxlen=RECENT_UNITS)
        self._theta: np.ndarray | None = None
        self._solved_at = 0
        self._prior_a = np.zeros((3, 3))
        self._prior_b = np.zeros(3)

    def set_prior(self, points: Sequence[tuple[np.ndarray, float]]) -> None:
        """Pseudo-points ``(x, y)`` of the four-term shape: the slopes' prior is their
        differences from the first (weight :data:`PRIOR_WEIGHT` in all, never decaying)."""
        (x0, y0), rest = points[0], points[1:]
        self._prior_a, self._prior_b = _prior_sums([(x[1:] - x0[1:], y - y0)
                                                    for x, y in rest])
        self._theta = None
        self._slopes_at = -1  # the prior is part of the slopes' fit

    def observe(self, x: np.ndarray, y: float) -> None:
        z = x[1:]
        self._block.append((z, y))
        self._recent.append((z, y))
        self.count += 1
        if len(self._block) == LEVEL_BLOCK:
            zs = np.array([b[0] for b in self._block])
            ys = np.array([b[1] for b in self._block])
            self._block = []
            if np.abs(zs - zs[0]).max() > 0.0:
                self._blocks.append((zs, ys))
                self._blocks_seen += 1

    def _robust_slopes(self) -> np.ndarray:
        """The slopes over the kept blocks by iteratively reweighted least squares with
        Huber's weights (each block's level its weighted mean, costs not negative, over
        the prior): an interval whose residual is more than :data:`HUBER_CLIP` noise
        deviations (the residuals' median absolute value over 0.6745, at least
        :data:`MIN_NOISE_FRACTION` of the median interval) weighs in inversely to its
        residual, so one odd interval moves the slopes by a bounded amount however far
        off it is. Refitted from the kept intervals each time: an early block that misled
        the fit does not hold it back once others outweigh it."""
        zs = np.array([b[0] for b in self._blocks])  # [blocks, LEVEL_BLOCK, 3]
        ys = np.array([b[1] for b in self._blocks])  # [blocks, LEVEL_BLOCK]
        age = BLOCK_FORGETTING ** np.arange(len(self._blocks) - 1, -1, -1.0)
        floor = MIN_NOISE_FRACTION * float(np.median(ys))
        weights = np.ones_like(ys)
        slopes = np.zeros(3)
        ridge = 1e-12 * np.eye(3)
        for _ in range(HUBER_ITERATIONS):
            w = weights * age[:, None]
            total = w.sum(1, keepdims=True)
            dz = (zs - (w[..., None] * zs).sum(1, keepdims=True)
                  / total[..., None]).reshape(-1, 3)
            dy = (ys - (w * ys).sum(1, keepdims=True) / total).reshape(-1)
            wdz = dz * w.reshape(-1, 1)
            slopes = _nonnegative_least_squares(wdz.T @ dz + self._prior_a + ridge,
                                                wdz.T @ dy + self._prior_b, self._free)
            residual = np.abs(dy - dz @ slopes).reshape(ys.shape)
            clip = HUBER_CLIP * max(float(np.median(residual)) / 0.6745, floor)
            new_weights = np.minimum(1.0, clip / np.maximum(residual, 1e-300))
            if np.abs(new_weights - weights).max() < 0.01:
                break  # the weights settled: the next solve would give these slopes
            weights = new_weights
        self._free = slopes > 0
        return slopes

    def _solve(self, fallback: np.ndarray) -> np.ndarray:
        if not self._blocks:
            slopes = fallback[1:]
        else:
            if self._slopes_at != self._blocks_seen or self._slopes is None:
                self._slopes = self._robust_slopes()
                self._slopes_at = self._blocks_seen
            slopes = self._slopes
        z = np.array([r[0] for r in self._recent])
        y = np.array([r[1] for r in self._recent])
        level = float(np.median(y - z @ slopes))
        return np.concatenate([[level], slopes])


def _target_features(num_reqs: int, draft_tokens: int) -> np.ndarray:
    """The target side's regressors: ``[1, B, S, S > 0]``. The last one is what a step
    pays for verifying anything at all (vLLM's rejection sampler and its spec-decode
    input path instead of the plain sampler, the drafts' attention path): without it the
    slope per draft token absorbed that fixed cost (on the real pair at batch 1, where
    nearly every step verifies one token, it priced a verified token at 5.7 ms where the
    step grows by about 1 ms per token) and the plan drafted too little."""
    return np.array([1.0, num_reqs, draft_tokens, float(draft_tokens > 0)])


def _unit(x: np.ndarray, seconds: float) -> float:
    """A target interval in units of the prior: ``seconds`` over the step's relative cost
    ``x . PRIOR_TARGET`` (``x``: :func:`_target_features`). Typical steps of any batch
    and length come out near the same value, whose median is the prior's scale."""
    return seconds / float(x @ _PRIOR_TARGET)


class MeasuredCosts:
    """The step cost model measured from the engine's own steps (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 refit_every: int = 1) -> None:
        self.clock = clock
        # refit_every: steps between two solves of each fit (see _Regression).
        # [1, B, S, S > 0]: level and slopes (see _LevelAndSlopes)
        self.target = _LevelAndSlopes(refit_every)
        # [1, anyone drafts, passes, rows, hole positions fed in the first pass]
        self.round = _Regression(5, refit_every)
        self.scale: float | None = None  # seconds per relative unit: the median step's
        self._units: deque[float] = deque(maxlen=RECENT_UNITS)
        self._first: list[tuple[np.ndarray, float]] = []  # the first steps, held
        self._outliers_in_a_row = 0
        self._round_end: float | None = None
        self._round_start: float | None = None
        self.skipped = 0  # intervals not used (prefill steps, outliers)
        self.rounds_clipped = 0
        # Intervals or rounds that measured no time (or less), after the catch-ups left out:
        # never observed (see round_begins). The first one's (seconds, excluded) is kept for
        # describe(): a clock or bookkeeping fault, not a cost.
        self.not_positive = 0
        self.first_not_positive: tuple[float, float] | None = None
        # Time inside the current interval or round spent catching up skipped first
        # passes (:meth:`exclude`), not counted in it.
        self._excluded = 0.0
        # The catch-ups' seconds and the positions they wrote (decaying sums): what a
        # skipped first pass leaves to be paid per position (StepCosts.skip_debt).
        self.catch_up_seconds = 0.0
        self.catch_up_positions = 0.0
        # ... and for the marginal cost per position (skip_debt): the decayed count of
        # catch-up passes and the sums of positions^2 and positions * seconds.
        self.catch_up_passes = 0.0
        self.catch_up_positions_sq = 0.0
        self.catch_up_cross = 0.0
        # Hole positions fed inside first passes (merged_catch_up; decaying, in step with
        # the sums above), and those of the current round (the round fit's hole term).
        self.merged_positions = 0.0
        self._merged_rows = 0

    def _prior_target(self) -> np.ndarray:
        return _PRIOR_TARGET * (self.scale or 1.0)

    def _prior_round(self) -> np.ndarray:
        return np.array(PRIOR_ROUND) * (self.scale or 1.0)

    def _set_scale(self, unit: float) -> None:
        """The prior's scale: ``unit`` seconds per relative unit (the median step's)."""
        self.scale = max(unit, 1e-12)
        pt, pr = self._prior_target(), self._prior_round()
        # Pseudo-points next to the origin: each says little about any slope. Points far
        # out (S = 32, 32 rows) weighed more on a slope than a hundred steps that all
        # verified 0-2 tokens, and pinned it to the prior: at batch 1 on the real pair
        # a verified token was priced at 3-6 ms for a measured ~1 ms, a lookahead pass
        # at 10 ms for a measured ~6 ms, and the plan drafted one token where the stop
        # rule alone drafted more, faster.
        self.target.set_prior([(x, float(x @ pt)) for x in (
            _target_features(1, 0), _target_features(2, 0), _target_features(1, 1),
            _target_features(1, 2))])
        self.round.set_prior([(x, float(x @ pr)) for x in (
            np.array([1.0, 0, 0, 0, 0]), np.array([1.0, 1, 0, 0, 0]),
            np.array([1.0, 1, 1, 1, 0]), np.array([1.0, 1, 1, 2, 0]),
            np.array([1.0, 1, 2, 2, 0]), np.array([1.0, 1, 0, 0, 1]))])

    def _rescale(self) -> None:
        """Follow the median step: the prior's pseudo-points never decay, so a scale taken
        from one step that was not typical priced what the data do not measure (drafting,
        while nobody drafts) at that step's cost for good. On an H200 the first timed
        interval took ~400 ms (kernels compiled on first use) where a step took 13 ms, and
        the prior then said a verified token cost 400 ms: the plan drafted on 3 of 638
        steps."""
        # statistics.median: the same value as np.median, without converting the deque
        # to an array on every step (a tenth of the control's host time at batch 1).
        median = float(statistics.median(self._units))
        if self.scale is None or abs(median - self.scale) > 0.1 * self.scale:
            self._set_scale(median)

    def _observe_target(self, x: np.ndarray, seconds: float, unit: float) -> None:
        self._units.append(unit)
        self.target.observe(x, seconds)

    def round_begins(self, num_reqs: int, draft_tokens: int | None) -> None:
        """A round starts: the interval since the last round ended was the target side of
        a step with ``num_reqs`` requests verifying ``draft_tokens`` drafts (None: the
        step had prefill tokens, or the count is unknown: not used)."""
        now = self.clock()
        last, self._round_end = self._round_end, None
        self._round_start = now
        excluded, self._excluded = self._excluded, 0.0
        if last is None or draft_tokens is None:
            self.skipped += last is not None
            return
        seconds = now - last - excluded
        if not seconds > 0.0:
            # No step takes no time: a catch-up left out of an interval that did not hold
            # it, or a clock fault. Observed, it would read as a free target step; a few
            # made the median step (the prior's scale) and the fit zero, and the plan
            # divided by a zero step time (an H200, V2, ``adaptive``: the engine died).
            self._not_positive(seconds, excluded)
            return
        x = _target_features(num_reqs, draft_tokens)
        if self.scale is None:
            # The first steps wait for each other: any one of them may be an outlier
            # (kernels compiled on first use), which only their median can tell.
            self._first.append((x, seconds))
            if len(self._first) < FIRST_STEPS:
                return
            units = [_unit(f, y) for f, y in self._first]
            median = float(np.median(units))
            for (f, y), u in zip(self._first, units):
                if u > OUTLIER_FACTOR * median:
                    self.skipped += 1
                else:
                    self._observe_target(f, y, u)
            self._first = []
            self._rescale()
            return
        unit = _unit(x, seconds)
        if unit > OUTLIER_FACTOR * self.scale:
            # Not a step (an idle gap between two generate calls, a compile), unless they
            # keep coming: then the steps themselves changed, and the median follows.
            self._outliers_in_a_row += 1
            if self._outliers_in_a_row < OUTLIERS_IN_A_ROW:
                self.skipped += 1
                return
            self._units.clear()
        self._outliers_in_a_row = 0
        self._observe_target(x, seconds, unit)
        self._rescale()

    def _not_positive(self, seconds: float, excluded: float) -> None:
        self.skipped += 1
        self.not_positive += 1
        if self.first_not_positive is None:
            self.first_not_positive = (seconds, excluded)

    def forget_interval(self) -> None:
        """The next interval is not one step's target side (a step ran without a round)."""
        self._round_end = None
        self._round_start = None
        self._excluded = 0.0
        self._merged_rows = 0

    def exclude(self, seconds: float, positions: int = 0) -> None:
        """``seconds`` of the current interval or round were a catch-up of skipped first
        passes (``DraftKVHoles``): not a cost of this step's choice. The draft KV of every
        position is written once whether its step drafted or not (by its first pass, or
        later by a catch-up), so what skipping saves is a pass's overhead, not that work;
        counted in the round, a catch-up made drafting look dearer the more steps had
        skipped (real pair, batch 1: the draft model's first pass fitted at 8.4 ms, and
        the plan drafted on 17% of steps for 0.97x where drafting one token on every step
        ran at 1.05x).

        ``positions``: how many positions' draft KV the catch-up wrote. Their cost per
        position is what skipping a first pass leaves to be paid later, per request
        (:attr:`StepCosts.skip_debt`): a skipped step saves the round's ``any_draft`` less
        that, not all of it."""
        self._excluded += seconds
        if positions > 0:
            d = CATCH_UP_DECAY
            self.merged_positions *= d
            self.catch_up_seconds = d * self.catch_up_seconds + seconds
            self.catch_up_positions = d * self.catch_up_positions + positions
            self.catch_up_passes = d * self.catch_up_passes + 1.0
            self.catch_up_positions_sq = d * self.catch_up_positions_sq + positions * positions
            self.catch_up_cross = d * self.catch_up_cross + positions * seconds

    def merged_catch_up(self, positions: int) -> None:
        """The current round's first pass fed ``positions`` hole positions in front of its
        queries (``DraftKVHoles.first_pass_with_holes``) instead of a catch-up pass of
        their own: rows of that pass, a term of the round's fit of their own (``hole``
        in the module doc), whose cost per position is what a skipped position costs
        (:meth:`skip_prices`)."""
        if positions <= 0:
            return
        self._merged_rows += positions
        d = CATCH_UP_DECAY
        self.merged_positions = d * self.merged_positions + positions
        self.catch_up_seconds *= d
        self.catch_up_positions *= d
        self.catch_up_passes *= d
        self.catch_up_positions_sq *= d
        self.catch_up_cross *= d

    def skip_debt(self, row_cost: float = 0.0, hole_cost: float | None = None) -> float:
        """Seconds per position a skipped first pass leaves to a later catch-up
        (:meth:`skip_prices`' first)."""
        return self.skip_prices(row_cost, hole_cost)[0]

    def skip_prices(self, row_cost: float = 0.0,
                    hole_cost: float | None = None) -> tuple[float, float]:
        """``(per position, per pass)``: what a skipped first pass leaves to a later
        catch-up, as a catch-up pass costs a fixed part plus a part per position.

        Per position: the slope of the catch-ups' seconds against the positions they
        wrote, at most the average per position; per pass, the fit's intercept at that
        slope (the catch-ups' mean seconds less the slope times their mean positions, not
        negative). The plan charges the first only (``StepCosts.skip_debt``); the second is
        reported (docs/cost-control.md, "What it does not do": pricing it apart was
        tried and measured). Where the passes' sizes barely vary
        the slope cannot be told from them: then the average, but no more than
        ``row_cost`` (the round's fitted cost of a lookahead row, a catch-up's rows being
        of that kind) where that is known, and the rest of a pass's mean seconds per pass.
        Why not the average per position alone: a catch-up of one position per request
        (the step before drafted) costs nearly a whole draft pass, and at batch 8 on the
        real pair that priced a skipped step at 3.2 ms per request: the plan then drafted
        for some request on 364 of 492 steps to spare it, and ran 0.86x of no speculation
        where drafting nothing ran about 1.0x (2026-11-26 16:52 UTC)."""
        if self.merged_positions > 0.0:
            # Holes ride in the next first pass (DraftKVHoles.first_pass_with_holes): a
            # skipped position costs a row of that pass (``hole_cost``, the round fit's
            # own term for them; a lookahead row's where not given), plus its share of
            # the passes that still run apart (blocks vLLM caches during a run of skips)
            # spread over every position caught up. No pass is left to a return from
            # skipping. Why a term of their own, not the lookahead rows': at batch 1
            # mtad's rows (4 beams a pass) move with its passes, and their fitted 1.65 ms
            # a row, charged to a hole position, priced a skip at 1.79 ms.
            spread = self.catch_up_seconds / (self.catch_up_positions + self.merged_positions)
            per = row_cost if hole_cost is None else hole_cost
            return max(per, 0.0) + spread, 0.0
        if self.catch_up_positions <= 0.0:
            return 0.0, 0.0
        average = self.catch_up_seconds / self.catch_up_positions
        n = self.catch_up_passes
        mean = self.catch_up_positions / n
        mean_seconds = self.catch_up_seconds / n
        variance = self.catch_up_positions_sq / n - mean * mean
        if n < 3.0 or variance < 0.25:
            per = min(average, row_cost) if row_cost > 0.0 else average
        else:
            slope = (self.catch_up_cross / n - mean * mean_seconds) / variance
            per = float(min(max(slope, 0.0), average))
        return per, max(mean_seconds - per * mean, 0.0)

    def round_ends(self, drafted: bool, passes: int, rows: int) -> None:
        now = self.clock()
        excluded, self._excluded = self._excluded, 0.0
        holes, self._merged_rows = self._merged_rows, 0  # fed in its first pass
        if self._round_start is not None and self.scale is not None:
            # The constant: what every round costs, drafting or not (the plan, the hole
            # bookkeeping), so not a cost of drafting. Without it a skipped round's ~1 ms
            # went into "anyone drafts" (real pair, batch 1, adaptive: 6.97 ms fitted
            # for 5.8 ms more than a skipped round), and the plan drafted too little.
            x = np.array([1.0, float(drafted), passes, rows, holes])
            seconds = now - self._round_start - excluded
            if not seconds >= 0.0:
                # As for a target interval (round_begins): no round takes negative time.
                self._not_positive(seconds, excluded)
                seconds = 0.0
            # A round far above its prior cost (its kernels compiled on first use) is
            # clipped, not dropped: a drafter that is dear every round stays dear.
            cap = ROUND_OUTLIER_FACTOR * max(float(x @ self._prior_round()),
                                             self.scale * PRIOR_ROUND[1])
            if seconds > cap:
                self.rounds_clipped += 1
                seconds = cap
            self.round.observe(x, seconds)
        self._round_start = None
        self._round_end = now

    def _thetas(self) -> tuple[np.ndarray, np.ndarray]:
        """The target's and the round's coefficients the plan uses (and describe() prints)."""
        t = self.target.theta(self._prior_target())
        r = self.round.theta(self._prior_round())
        if not (np.isfinite(t).all() and np.isfinite(r).all() and t[0] + t[1] > 0.0):
            # A plain one-request step must cost something for a rate to exist; a fit
            # that says otherwise is not used (the prior's relative costs are).
            t, r = self._prior_target(), self._prior_round()
        return t, r

    def step_costs(self) -> StepCosts:
        t, r = self._thetas()
        # The target's fixed cost of verifying anything (t[3]) is paid exactly when the
        # round's is: one "anyone drafts" term.
        debt = self.skip_debt(row_cost=float(r[3]), hole_cost=float(r[4]))
        return StepCosts(target_base=float(t[0]), target_per_request=float(t[1]),
                         target_per_token=float(t[2]), draft_pass=float(r[2]),
                         draft_row=float(r[3]), draft_round=float(r[1] + t[3]),
                         verify_fixed=float(t[3]), skip_debt=debt)

    def describe(self) -> dict[str, Any]:
        c = self.step_costs()
        any_verified = c.verify_fixed
        always = float(self._thetas()[1][0])
        return {
            "source": "measured online" if self.target.count else "prior",
            "target_steps_measured": self.target.count,
            "rounds_measured": self.round.count,
            "intervals_skipped": self.skipped,
            "rounds_clipped": self.rounds_clipped,
            "not_positive": self.not_positive,
            **({"first_not_positive_ms": [1e3 * v for v in self.first_not_positive]}
               if self.first_not_positive is not None else {}),
            "target_ms": {"base": 1e3 * c.target_base, "per_request": 1e3 * c.target_per_request,
                          "per_draft_token": 1e3 * c.target_per_token,
                          "any_verified": 1e3 * any_verified},
            # The round's own; the plan prices any_draft + any_verified together, and not
            # "always" (paid by every step, drafting or not).
            "round_ms": {"always": 1e3 * always,
                         "any_draft": 1e3 * (c.draft_round - any_verified),
                         "per_pass": 1e3 * c.draft_pass,
                         "per_row": 1e3 * c.draft_row,
                         "skip_debt_per_request": 1e3 * c.skip_debt,
                         "per_hole_position": 1e3 * float(self._thetas()[1][4]),
                         # Not charged (skip_prices): reported.
                         "catch_up_pass": 1e3 * self.skip_prices(
                             row_cost=float(self._thetas()[1][3]))[1]},
        }


def probe_could_pay(choice: LengthChoice, costs: StepCosts) -> bool:
    """Whether a probe (one draft token for a request planned at zero,
    :meth:`AcceptanceHistory.probes`) could pay for itself: it would raise the step's
    expected rate if it were certainly accepted. A token accepted for sure adds one token
    to the step's ``E`` and costs its verification row, plus the round's "anyone drafts"
    cost (the drafter's first pass and draws, the verification path) when nobody else
    drafts. When even that does not pay (large batches on a CPU:
    on the real pair at batch 32 a probe step cost about 0.9 of a step for the 0.38
    token its probe earned), probing only costs, and its answer could not change the
    plan; the request stays due and probes once it could pay (the batch shrinks, or
    others draft).

    The catch-up a skipped step leaves (``skip_debt``) is not counted as spared by a probe:
    with it a probe at batch 8 spared eight requests' debt and paid wherever one token
    nearly paid on its own; probes then ran every other step, each leaving holes of a
    position or two whose catch-ups (nearly a whole pass each) kept the debt high, and
    `adaptive` drafted for some request on 338 of 491 steps at 0.87x of no speculation
    (real pair, T = 0, 2026-11-26 17:00 UTC). Where nobody drafts for long the debt is
    never paid at all (the request retires, ``DraftKVHoles.retire_after``)."""
    extra = costs.target_per_token
    if not choice.lengths.any():
        extra += costs.draft_round
    return 1.0 > extra * choice.rate


def _plain_step_choice(costs: StepCosts, num_reqs: int) -> LengthChoice:
    """The choice that drafts nothing for ``num_reqs`` requests: one token each in the
    plain step's time (``StepCosts.step_time`` of zero lengths); rate 0 where that time is
    not a positive finite number (no model to judge by)."""
    lengths = np.zeros(num_reqs, dtype=np.int64)
    plain = costs.step_time(lengths)
    rate = num_reqs / plain if plain > 0.0 and np.isfinite(plain) else 0.0
    return LengthChoice(lengths, rate, float(num_reqs), plain)


@dataclass
class RoundPlan:
    rule: DraftStopRule
    caps: torch.Tensor  # [R] int64, host: the most each request may draft (0: nothing)
    rate: float  # the plan's expected tokens per second (per unit of the cost model)
    # Set by a drafter that planned before its first pass: nobody drafts and the first
    # pass is skipped (glue/draft_passes.py, DraftKVHoles).
    skip_first_pass: bool = False


@dataclass
class CostControlStats:
    steps: int = 0
    all_zero_steps: int = 0
    partial_zero_steps: int = 0
    planned_tokens: int = 0
    probes: int = 0
    # Beam rounds (plan_depths): how many request-rounds were planned at each depth.
    depths: dict[int, int] = field(default_factory=dict)


class CostControl:
    """Per-step draft lengths for one chain drafter (see the module doc)."""

    def __init__(self, k_max: int, clock: Callable[[], float] = time.perf_counter,
                 retired: Callable[[], Container[str]] | None = None,
                 refit_every: int = 1) -> None:
        self.k_max = k_max
        # The requests that must draft nothing (their draft KV has gaps): planned zero.
        self.retired = retired
        self.costs = MeasuredCosts(clock, refit_every)
        self.history = AcceptanceHistory(k_max)
        # A fixed model (tests, or a user who measured theirs): used instead of the
        # measured one; measuring goes on.
        self.fixed_costs: StepCosts | None = None
        self.stats = CostControlStats()
        self._idle_plans = 0  # plans in a row that drafted nothing for anyone
        self._drafted: dict[str, int] = {}  # request id -> tokens drafted last round
        # The cost stop's reading of the draft's confidence (its acceptance at that
        # confidence), learnt from the same verified steps as the history.
        self.calibration = ConfidenceCalibration()
        self._confidences: dict[str, list[float]] = {}  # request id -> last round's

    def step_costs(self) -> StepCosts:
        return self.fixed_costs if self.fixed_costs is not None else self.costs.step_costs()

    def begin(self, req_ids: Sequence[str] | None, num_rejected: torch.Tensor | None,
              target_tokens: int | None) -> None:
        """At the start of a round: time the step that just ran and learn each request's
        acceptance from the drafts it verified (``num_rejected``: per row)."""
        num_reqs = len(req_ids) if req_ids is not None else 0
        draft_tokens = None
        if target_tokens is not None and target_tokens >= num_reqs > 0:
            extra = target_tokens - num_reqs
            if extra <= num_reqs * self.k_max:  # decode (+ verification) only
                draft_tokens = extra
        self.costs.round_begins(num_reqs, draft_tokens)
        if req_ids is None or num_rejected is None:
            return
        drafted = [self._drafted.get(rid, 0) for rid in req_ids]
        if not any(drafted):
            # Nothing was drafted, so nothing to learn, and no read of the rejected
            # counts: on a GPU that read waits for the step that just ran, every step
            # while nobody drafts, and vLLM's asynchronous scheduling loses its overlap.
            return
        rejected = num_rejected.to("cpu").tolist()[:num_reqs]
        if draft_tokens is not None and draft_tokens != sum(drafted):
            # The step did not verify last round's drafts as drafted (a step ran without
            # a round, the scheduler cut or dropped drafts, a request was still in
            # prefill): a request with no rejections there may have verified nothing, so
            # nothing is learned rather than false acceptances.
            return
        accepted = [n - int(r) for n, r in zip(drafted, rejected)]
        self.history.observe_many(req_ids, drafted, accepted)
        if self._confidences:
            self.calibration.observe([self._confidences.get(rid) for rid in req_ids],
                                     accepted)
        if len(self._drafted) > 4 * max(num_reqs, 64):
            self._drafted = {r: self._drafted[r] for r in req_ids if r in self._drafted}
            self._confidences = {r: self._confidences[r] for r in req_ids
                                 if r in self._confidences}
            self.history.forget_except(req_ids)

    def retires_arrivals(self, num_reqs: int, idle_plans: int) -> bool:
        """Whether a request that joins the batch now (``num_reqs`` with it) should retire
        on arrival, and the batch's requests with it (``DraftKVHoles.admit``): the last
        ``idle_plans`` plans in a row drafted nothing for anyone (no probe either), and not
        even a certainly accepted token would pay at this batch size
        (:meth:`sure_token_pays`), so nothing would make it draft until the batch shrinks.
        While the plan drafts for some requests, new ones are admitted: they arrive at the
        pooled acceptance the plan is drafting at."""
        return self._idle_plans >= idle_plans and not self.sure_token_pays(num_reqs)

    def sure_token_pays(self, num_reqs: int) -> bool:
        """Whether one draft token, certainly accepted, drafted for one request of a batch
        of ``num_reqs`` where nobody else drafts, would raise the step's rate at the
        current costs (:func:`probe_could_pay` of a plan that drafts nothing). When it
        would not, no plan at that batch size drafts for a request on its own account."""
        costs = self.step_costs()
        plain = _plain_step_choice(costs, max(int(num_reqs), 1))
        if plain.rate == 0.0:
            return True  # no model to judge by: say nothing against drafting
        return probe_could_pay(plain, costs)

    def _choose(self, req_ids: Sequence[str], k: int,
                widths: Sequence[int] | np.ndarray | int | None = None,
                ) -> tuple[np.ndarray, StepCosts, LengthChoice, np.ndarray]:
        """The step's choice for the chain plan and the beam depth plan alike: each
        request's acceptance rates for positions ``1..k`` (``[R, k]``; zero for a retired
        request: no gain, it is planned nothing), the costs, the exact length choice, and
        the caps (the choice with the probes due, retired requests at zero); counted in
        the stats."""
        gone = self.retired() if self.retired is not None else ()
        retired = (np.fromiter((rid in gone for rid in req_ids), dtype=bool,
                               count=len(req_ids)) if gone else None)
        costs = self.step_costs()
        if retired is not None and retired.all():
            # Every request of the batch is retired (batch 8-32 on a CPU host, once drafting
            # never paid): the choice is all zeros whatever the rates, and a retired
            # request never probes, so nothing is weighed (that ran on every step of such
            # a batch).
            rates = np.zeros((len(req_ids), k))
            choice = _plain_step_choice(costs, len(req_ids))
            caps = choice.lengths.copy()
        else:
            rates = self.history.rates(req_ids)[:, :k]
            if retired is not None and retired.any():
                rates = rates.copy()
                rates[retired] = 0.0
            choice = choose_draft_lengths(expected_gains(rates), costs, widths=widths,
                                          min_gain=MIN_PLAN_GAIN)
            caps = self.history.probes(req_ids, choice.lengths,
                                       may_probe=probe_could_pay(choice, costs))
            if retired is not None:
                caps[retired] = 0
        self.stats.steps += 1
        self.stats.probes += int((caps > choice.lengths).sum())
        self.stats.planned_tokens += int(caps.sum())
        self._idle_plans = 0 if caps.any() else self._idle_plans + 1
        if not caps.any():
            self.stats.all_zero_steps += 1
        elif not caps.all():
            self.stats.partial_zero_steps += 1
        return rates, costs, choice, caps

    def plan(self, req_ids: Sequence[str], k_max: int, inner: DraftStopRule,
             device: torch.device) -> RoundPlan:
        """This round's lengths and its stop rule (the cost stop over ``inner``)."""
        k = min(k_max, self.k_max)
        rates, costs, choice, caps = self._choose(req_ids, k)
        if not caps.any():
            # Nobody drafts: no rule runs (a drafter that planned before its first pass
            # skips the round; one that did not returns before its first draw).
            return RoundPlan(inner, torch.zeros(len(req_ids), dtype=torch.int64), choice.rate)
        threshold = choice.rate * (costs.target_per_token + costs.draft_row)
        if isinstance(inner, HeadStop):
            signal, head = "head", inner.head
        elif isinstance(inner, ConfidenceStop):
            signal, head = inner.signal, None
        else:
            signal, head = "history", None
        pass_threshold = 0.0
        if signal != "history":
            # The round reads each draft's confidence (or the acceptance head): it decides
            # how deep a request goes online, at the plan's costs, the shared lookahead
            # pass included (CostStop's pass_threshold). The plan's lengths, from
            # acceptance alone, say only who drafts at all: held to them, a confident
            # draft stopped where the stop rule alone went on and paid (real pair,
            # batch 1, T = 0, specx_eagle3 adaptive: mean draft 1.12 tokens against 1.38
            # without the control, 1.135x against 1.196x of no speculation).
            caps = np.where(caps > 0, k, 0)
            pass_threshold = choice.rate * costs.draft_pass
        caps_t = torch.as_tensor(caps, dtype=torch.int64)
        calibration = (self.calibration.device_table(device)
                       if signal not in ("head", "history") else None)
        rule = CostStop(inner, caps_t.to(device),
                        torch.as_tensor(rates, dtype=torch.float32, device=device),
                        threshold, signal=signal, head=head, calibration=calibration,
                        pass_threshold=pass_threshold)
        return RoundPlan(rule, caps_t, choice.rate)

    def plan_depths(self, req_ids: Sequence[str], k_max: int,
                    widths: Sequence[int] | np.ndarray | int) -> np.ndarray:
        """Each request's draft depth for a beam round (``mtad``), ``[R]`` int64 on the
        host: its beam search stops at that depth and leaves the later lookahead passes
        (``beam_search_batched``'s ``row_depth``), where it carries ``widths[r]`` rows
        (its beams; 1 for a greedy argmax chain), so the chain's exact choice with those
        widths (``choose_draft_lengths``). A request due a probe (idle for
        ``probe_interval`` steps, where one sure token would pay) drafts one token. All
        zero: a plain decode step."""
        _, _, _, caps = self._choose(req_ids, min(k_max, self.k_max), widths)
        for depth, count in zip(*np.unique(caps, return_counts=True)):
            self.stats.depths[int(depth)] = self.stats.depths.get(int(depth), 0) + int(count)
        return caps

    def end(self, req_ids: Sequence[str] | None, lengths: Sequence[int], passes: int,
            rows: int, confidences: torch.Tensor | None = None) -> None:
        """At the end of a round: what each request drafted (``confidences``: the cost
        stop's raw confidence per row and depth, :meth:`CostStop.confidences`, on the
        host), for the next step's :meth:`begin` to learn from."""
        if req_ids is not None:
            rows_read = confidences.tolist() if confidences is not None else None
            for i, (rid, n) in enumerate(zip(req_ids, lengths)):
                self._drafted[rid] = int(n)
                if rows_read is not None and n > 0:
                    self._confidences[rid] = rows_read[i][:int(n)]
                else:
                    self._confidences.pop(rid, None)
        self.costs.round_ends(any(n > 0 for n in lengths), passes, rows)

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "model": ("fixed " + str(self.fixed_costs)) if self.fixed_costs is not None
            else self.costs.describe(),
            "steps": s.steps, "all_zero_steps": s.all_zero_steps,
            "partial_zero_steps": s.partial_zero_steps, "probes": s.probes,
            "pooled_acceptance": [round(float(a), 3) for a in self.history.pooled_rates()],
            "confidence_calibration": {
                "bin_edges": [float(e) for e in self.calibration.edges],
                "accept_given_confidence": [round(float(p), 3)
                                            for p in self.calibration.table()],
                "tokens": [round(float(t), 1) for t in self.calibration.tried],
            },
            **({"depth_histogram": {str(d): n for d, n in sorted(s.depths.items())}}
               if s.depths else {}),
        }
