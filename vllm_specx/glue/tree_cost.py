"""Cost control for draft trees (issue 37, issue 32 item 3): after a tree drafter has
drafted every request's tree, keep per request only the nodes that pay at the engine's own
measured step costs (``algorithms/tree_budget.py``), down to zero nodes (a plain step).

No vLLM import: the tree rounds (``glue/eagle_tree_proposer.py``, the draft-model tree in
``glue/mtad_proposer.py``) call :class:`TreeCostControl`.

* **Costs**: the same :class:`~.cost_model.MeasuredCosts` the chain control learns, fed
  with the tree steps themselves: the target side of a step verifying ``S`` kept nodes
  over ``B`` requests (nodes are query tokens, as a chain's drafts are) and the tree
  round's head/draft passes and rows. ``target(S)`` and the drafter's already-paid time
  come from it through ``tree_budget.step_costs_target`` / ``step_costs_paid``.
* **Values**: ``v(n) = min(1, scale * q(path to n))`` (``calibrated_path_values``), with
  ``q`` the drafter's joint probability of the node's path. ``scale`` is learnt simply:
  the ratio of the accepted path lengths to the predicted sum of ``q`` over the kept
  nodes, both with forgetting (about the last 50 request-steps), over a prior of ratio 1,
  clamped to ``[0.25, 2]``.
* **Lossless**: any rooted subtree is lossless under the deterministic tree rule. The
  sampled i.i.d. rule is lossless only where whether a node's children are verified does
  not depend on what they drew, so those trees are not pruned: their depth is chosen
  before drafting (:meth:`TreeCostControl.choose_depth`) and they are verified whole
  (:meth:`TreeCostControl.verified_whole`).

Tests inject a fixed model (:attr:`TreeCostControl.fixed_costs`), as the chain control's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from vllm_specx.algorithms.draft_length import StepCosts
from vllm_specx.algorithms.tree_budget import (
    calibrated_path_values,
    choose_tree_depth,
    node_depths,
    prune_trees,
    step_costs_paid,
    step_costs_target,
)
from vllm_specx.glue.cost_model import (
    REFIT_EVERY,
    MeasuredCosts,
    cost_control_applies,
    engine_step_clock,
    retired_requests,
)

SCALE_BOUNDS = (0.25, 2.0)
SCALE_FORGETTING = 0.98  # per request-step: ~50 request-steps
SCALE_PRIOR = 2.0  # pseudo-tokens of ratio 1 (never decays)
DEPTH_FORGETTING = 0.9  # per round, for the per-depth kept value and nodes
PROBE_EVERY = 8  # rounds: a round drafted shallower than the full depth is followed, at
# the latest this many rounds later, by a probe one depth deeper than the choice, so that
# depth's value is measured again (depths are only learnt from rounds that drafted them).
# One depth deeper, not the full depth: where nothing pays (real pair, `adaptive` tree,
# batch 8, T = 1) a full-depth round verified 128 nodes, about 7 plain steps, and the
# first rounds and probes at the full depth were most of what kept the control at 0.79x.
# A probe whose probed depth did not pay (a pruned tree kept no node there; a whole tree's
# accepted paths do not make that depth the best) doubles the wait for the next (up to
# this many rounds); one that paid, or a round whose own choice is the full depth, brings
# it back to PROBE_EVERY. Why: where nothing pays (real pair, EAGLE-3 tree 8/4/2, batch 8,
# T = 1) the probes were the only rounds that drafted, one in 8, each paying head passes
# for a tree cut to nothing: 0.86x of no speculation.
MAX_PROBE_EVERY = 64


@dataclass
class TreeRoundPlan:
    """A tree round's depth, chosen by the tree cost control before the first pass
    (``RoundStart.plan``); depth 0 is a plain step whose first pass is skipped."""

    depth: int
    skip_first_pass: bool


@dataclass
class TreeCostStats:
    """What the tree control did (``specx_stats()["tree_cost_control"]``)."""

    rounds: int = 0
    all_zero_rounds: int = 0
    drafted_nodes: int = 0
    kept_nodes: int = 0
    # Rounds verified whole at the depth chosen before drafting (sampled i.i.d. trees).
    whole_rounds: int = 0
    kept_histogram: dict[int, int] = field(default_factory=dict)  # kept nodes per request


class TreeCostControl:
    """Per-round pruning of a tree drafter's trees (see the module doc)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 refit_every: int = 1) -> None:
        self.costs = MeasuredCosts(clock, refit_every)
        self.fixed_costs: StepCosts | None = None  # tests: used instead of the measured
        self.stats = TreeCostStats()
        self._accepted = 0.0  # forgetting sums of accepted path lengths ...
        self._predicted = 0.0  # ... and of the kept nodes' summed path probability q
        # request id -> (kept nodes, their summed q) of the last round; its total.
        self._last: dict[str, tuple[int, float]] = {}
        self._last_total: int | None = None
        # Per depth d (index d - 1): kept value and kept nodes per request, averaged over
        # the rounds that drafted that depth (None: never drafted yet).
        self._depth_value: list[float | None] = []
        self._depth_nodes: list[float | None] = []
        # The same for trees verified whole (sampled i.i.d. children): per depth the
        # fraction of request-rounds whose accepted path reached it, and its nodes,
        # learnt from the verified steps (verified_whole, then begin).
        self._whole_value: list[float | None] = []
        self._whole_nodes: list[float | None] = []
        # The last whole round: request id -> its nodes per depth; whether it probed.
        self._whole_last: dict[str, list[int]] = {}
        self._whole_probe = False
        self._idle_rounds = 0  # rounds in a row that verified no node (retires_arrivals)
        self._since_probe = 0
        self.probe_every = PROBE_EVERY  # rounds between probes (backs off)
        self._probing = False  # this round (of depth _chosen_depth) probes, not yet pruned
        # The depth choose_depth gave this round (0: none given): the depths down to it
        # are learnt from the round's trees even where none of its nodes reached the
        # deepest (a dynamic tree keeps its best max_nodes nodes, which may all be
        # shallower): that depth was worth nothing this round, not left unmeasured.
        self._chosen_depth = 0

    @property
    def scale(self) -> float:
        ratio = (self._accepted + SCALE_PRIOR) / (self._predicted + SCALE_PRIOR)
        return float(min(max(ratio, SCALE_BOUNDS[0]), SCALE_BOUNDS[1]))

    def step_costs(self) -> StepCosts:
        return self.fixed_costs if self.fixed_costs is not None else self.costs.step_costs()

    def begin(self, req_ids: Sequence[str] | None, num_rejected: torch.Tensor | None,
              target_tokens: int | None) -> None:
        """At the start of a tree round (after the first pass): time the step that just
        ran (it verified ``target_tokens - R`` nodes) and learn the acceptance scale from
        the paths it accepted (``num_rejected``: kept nodes minus accepted, per row)."""
        num_reqs = len(req_ids) if req_ids is not None else 0
        nodes = None
        if (target_tokens is not None and num_reqs > 0 and self._last_total is not None
                and target_tokens - num_reqs == self._last_total):
            # A decode step over exactly last round's kept trees (a prefill chunk, a cut
            # or dropped tree would change the count: not this step's cost or acceptance).
            nodes = target_tokens - num_reqs
        self.costs.round_begins(num_reqs, nodes)
        whole, self._whole_last = self._whole_last, {}
        if nodes is None or req_ids is None or num_rejected is None:
            return
        rejected = num_rejected.to("cpu").tolist()[:num_reqs]
        if whole:
            self._learn_whole(req_ids, rejected, whole)
            return
        for rid, rej in zip(req_ids, rejected):
            kept, q_sum = self._last.get(rid, (0, 0.0))
            if kept == 0:
                continue
            accepted = max(kept - int(rej), 0)
            self._accepted = SCALE_FORGETTING * self._accepted + accepted
            self._predicted = SCALE_FORGETTING * self._predicted + q_sum

    def prune(self, req_ids: Sequence[str], parents: Sequence[torch.Tensor],
              path_logq: Sequence[torch.Tensor], passes: int, rows: int,
              whole_groups: Sequence[bool] | None = None,
              retired: Container[str] = ()) -> list[np.ndarray]:
        """Per request a bool mask of the nodes to keep (a rooted subtree of its BFS
        tree); ``path_logq``: each node's cumulative draft log-probability; ``passes`` /
        ``rows``: the tree round's drafter passes and their rows (already paid).
        ``retired``: requests whose draft KV upkeep stopped (``DraftKVHoles.retired``):
        their drafts read a head KV with holes, so none of their nodes is kept."""
        par = [p.to("cpu", torch.int64).numpy() for p in parents]
        q = [np.exp(s.to("cpu", torch.float64).numpy()) for s in path_logq]
        scale = self.scale
        values = [np.zeros(len(p)) if rid in retired else calibrated_path_values(p, qq, scale)
                  for rid, p, qq in zip(req_ids, par, q)]
        costs = self.step_costs()
        drafted = any(len(p) for p in par)
        budget = prune_trees(par, values, step_costs_paid(costs, drafted, passes, rows),
                             step_costs_target(costs, len(par)), whole_groups=whole_groups)
        if retired and any(rid in retired and k.any() for rid, k in zip(req_ids, budget.keep)):
            # Zero values never pay where a node costs anything; a free node (a cost model
            # of zeros) still must not be verified from a head KV with holes.
            keep = [np.zeros_like(k) if rid in retired else k
                    for rid, k in zip(req_ids, budget.keep)]
            budget = replace(budget, keep=keep, total_nodes=int(sum(k.sum() for k in keep)))
        self._last = {}
        for rid, keep, qq in zip(req_ids, budget.keep, q):
            self._last[rid] = (int(keep.sum()), float(np.minimum(qq[keep], 1.0).sum()))
        self._last_total = budget.total_nodes
        self._idle_rounds = 0 if budget.total_nodes else self._idle_rounds + 1
        depths = [node_depths(p) for p in par]
        if self._probing:
            self._probing = False
            # Paid: the probed depth kept a node (a rooted subtree: so did every depth above).
            self._probe_paid(any(bool((d[k] >= self._chosen_depth).any())
                                 for d, k in zip(depths, budget.keep)))
        # Per request that may draft: choose_depth scales by those (a retired request's
        # zero values would otherwise dilute what a depth is worth to the others).
        active = sum(rid not in retired for rid in req_ids) if retired else len(par)
        if active:
            self._learn_depths(depths, values, budget.keep, active, self._chosen_depth)
        self._chosen_depth = 0
        s = self.stats
        s.rounds += 1
        s.all_zero_rounds += budget.total_nodes == 0
        s.drafted_nodes += sum(len(p) for p in par)
        s.kept_nodes += budget.total_nodes
        for keep in budget.keep:
            n = int(keep.sum())
            s.kept_histogram[n] = s.kept_histogram.get(n, 0) + 1
        return budget.keep

    def verified_whole(self, req_ids: Sequence[str], depth_sizes: Sequence[int]) -> None:
        """A round whose trees are verified whole at the depth :meth:`choose_depth` chose
        before drafting (``whole=True``; i.i.d. children for the ``"sampled"`` rule:
        keeping or dropping a node's children by what they drew would condition the draws
        the rule needs unconditioned, so nothing is pruned after drafting). Every request
        drafted ``depth_sizes`` nodes a depth. The step after it is timed over every node,
        and what each depth was worth is learnt from that step's verification
        (:meth:`begin`): how often the accepted path reached it, not the draft's ``q``
        (``b`` i.i.d. draws of one token are one chance, not ``b``; and the acceptance
        scale calibrates the top-k trees' ``q``)."""
        sizes = [int(n) for n in depth_sizes]
        total = sum(sizes) * len(req_ids)
        self._last = {rid: (0, 0.0) for rid in req_ids}
        self._last_total = total
        self._whole_last = {rid: sizes for rid in req_ids}
        self._whole_probe, self._probing = self._probing, False
        self._chosen_depth = 0
        self._idle_rounds = 0 if total else self._idle_rounds + 1
        s = self.stats
        s.rounds += 1
        s.whole_rounds += 1
        s.all_zero_rounds += total == 0
        s.drafted_nodes += total
        s.kept_nodes += total
        s.kept_histogram[sum(sizes)] = s.kept_histogram.get(sum(sizes), 0) + len(req_ids)

    def _learn_whole(self, req_ids: Sequence[str], rejected: Sequence[int],
                     drafted: dict[str, list[int]]) -> None:
        """What each depth of the last whole round was worth: per depth, the fraction of
        its requests whose accepted path reached it (``rejected``: the verified nodes less
        the accepted path, per row), and its nodes; forgetting per round as for the pruned
        trees. A probe whose trees, valued so, still would not pay at the probed depth
        doubles the wait for the next (as a pruned probe that kept no node there)."""
        deepest = max((len(v) for v in drafted.values()), default=0)
        reached = np.zeros(deepest)
        tried = np.zeros(deepest)
        nodes = np.zeros(deepest)
        for rid, rej in zip(req_ids, rejected):
            sizes = drafted.get(rid)
            if not sizes:
                continue
            accepted = min(max(sum(sizes) - int(rej), 0), len(sizes))
            depth = len(sizes)
            tried[:depth] += 1.0
            reached[:accepted] += 1.0
            nodes[:depth] += sizes
        with np.errstate(invalid="ignore"):  # a depth nobody drafted: NaN, not learnt
            _forget_into(self._whole_value, self._whole_nodes, reached / tried,
                         nodes / tried)
        if self._whole_probe:
            self._whole_probe = False
            active = max(len(drafted), 1)
            self._probe_paid(self._best_depth(active, deepest, True, False) == deepest)

    def _learn_depths(self, depths: list[np.ndarray], values: list[np.ndarray],
                      keep: list[np.ndarray], num_reqs: int, drafted_depth: int = 0) -> None:
        """``depths``: each tree's node depths (``node_depths``)."""
        deepest = max((int(d.max()) for d in depths if len(d)), default=0)
        deepest = max(deepest, drafted_depth)
        value = np.zeros(deepest)
        nodes = np.zeros(deepest)
        for d, v, k in zip(depths, values, keep):
            np.add.at(value, d[k] - 1, v[k])
            np.add.at(nodes, d[k] - 1, 1.0)
        _forget_into(self._depth_value, self._depth_nodes, value / num_reqs, nodes / num_reqs)

    def _probe_paid(self, paid: bool) -> None:
        """A probe's outcome: one that paid (kept a node at the probed depth; for whole
        trees, the probed depth would pay) brings the usual pace back, one that did not
        doubles the wait for the next (up to :data:`MAX_PROBE_EVERY`)."""
        self.probe_every = (PROBE_EVERY if paid else
                            min(2 * self.probe_every, MAX_PROBE_EVERY))

    def choose_depth(self, num_reqs: int, max_depth: int,
                     skips_first_pass: bool = False, whole: bool = False) -> int:
        """Tree depth to draft this round, before any head pass (``choose_tree_depth``):
        depth ``d >= 2`` costs one more head pass over the batch; 0 drafts nothing.

        Depths are measured one at a time, never all at once: with nothing measured the
        round drafts depth 1; a depth never drafted yet is valued as the deepest measured
        one (an upper bound: a path reaches depth ``d + 1`` only through depth ``d``), and
        where that says it might pay, the round drafts one depth deeper than measured.
        Every :attr:`probe_every` rounds (:data:`PROBE_EVERY`, doubled per probe whose
        probed depth did not pay, up to :data:`MAX_PROBE_EVERY`) the round probes one
        depth deeper than its choice, so a value learnt when drafts were poor is measured
        again. ``num_reqs``: the requests that may draft (0: depth 0, no probe).
        ``skips_first_pass``: chosen before the first pass, which depth 0 then skips
        (its KV caught up later: ``skip_debt`` per request is depth 0's cost).
        ``whole``: for trees verified whole (:meth:`verified_whole`), valued by how often
        their accepted paths reached each depth; else the pruned trees' kept values."""
        depth = self._choose_depth(num_reqs, max_depth, skips_first_pass, whole)
        self._chosen_depth = depth
        return depth

    def _choose_depth(self, num_reqs: int, max_depth: int, skips_first_pass: bool,
                      whole: bool) -> int:
        if num_reqs <= 0 or max_depth <= 0:
            return 0
        values = (self._whole_value if whole else self._depth_value)[:max_depth]
        measured = next((i for i, v in enumerate(values) if v is None), len(values))
        if measured == 0:
            return 1
        depth = self._best_depth(num_reqs, max_depth, whole, skips_first_pass)
        if depth > measured:
            return measured + 1  # might pay: draft the first depth not measured yet
        if depth == max_depth:
            self._since_probe = 0
            self.probe_every = PROBE_EVERY  # the full depth pays: probes at the usual pace
            return depth
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            self._probing = True
            return depth + 1
        return depth

    def _best_depth(self, num_reqs: int, max_depth: int, whole: bool,
                    skips_first_pass: bool) -> int:
        """``choose_tree_depth`` over the learnt per-depth values; a depth not measured
        yet is valued as the deepest measured one above it (nothing, above none)."""
        values = self._whole_value if whole else self._depth_value
        nodes = self._whole_nodes if whole else self._depth_nodes
        depth_values: list[float] = []
        depth_nodes: list[int] = []
        for d in range(max_depth):
            v = values[d] if d < len(values) else None
            if v is None:  # not measured: the deepest measured depth's value and nodes
                depth_values.append(depth_values[-1] if depth_values else 0.0)
                depth_nodes.append(depth_nodes[-1] if depth_nodes else 0)
                continue
            depth_values.append(num_reqs * float(v))
            depth_nodes.append(int(round(num_reqs * float(nodes[d] or 0.0))))
        costs = self.step_costs()
        pass_cost = costs.draft_pass + costs.draft_row * num_reqs
        return choose_tree_depth(
            depth_values, depth_nodes, num_reqs, costs.fixed,
            [costs.draft_round] + [pass_cost] * (max_depth - 1),
            step_costs_target(costs, num_reqs),
            skip_cost=costs.skip_debt * num_reqs if skips_first_pass else 0.0)

    def retires_arrivals(self, num_reqs: int, idle_plans: int) -> bool:
        """Whether a request that joins the batch now (``num_reqs`` with it) should retire
        on arrival, and the batch's requests with it (``DraftKVHoles.admit``), as the chain
        control's
        (``CostControl.retires_arrivals``): the last ``idle_plans`` rounds in a row
        verified no node, and not even one node, certainly accepted, of one request's
        tree would pay at this batch size (:meth:`sure_node_pays`)."""
        return self._idle_rounds >= idle_plans and not self.sure_node_pays(num_reqs)

    def sure_node_pays(self, num_reqs: int) -> bool:
        """Whether one tree node, certainly accepted, drafted for one request of a batch
        of ``num_reqs`` where nobody else drafts would raise the step's rate: its
        verification row and the round's drafting cost against a plain step that leaves
        that request's first pass to a later catch-up."""
        costs = self.step_costs()
        num_reqs = max(int(num_reqs), 1)
        return choose_tree_depth([1.0], [1], num_reqs, costs.fixed, [costs.draft_round],
                                 step_costs_target(costs, num_reqs),
                                 skip_cost=costs.skip_debt) == 1

    def skipped(self, req_ids: Sequence[str]) -> None:
        """A round that drafted nothing (depth 0): its step verifies no node; the round
        ends here (timed as one that did not draft)."""
        self._last = {rid: (0, 0.0) for rid in req_ids}
        self._last_total = 0
        self._idle_rounds += 1
        self._chosen_depth = 0
        self.stats.rounds += 1
        self.stats.all_zero_rounds += 1
        self.stats.kept_histogram[0] = self.stats.kept_histogram.get(0, 0) + len(req_ids)
        self.end(0, 0, drafted=False)

    def end(self, passes: int, rows: int, drafted: bool = True) -> None:
        self.costs.round_ends(drafted, passes, rows)

    def forget_interval(self) -> None:
        """A step ran without a round: the next interval is not one step."""
        self.costs.forget_interval()
        self._last_total = None

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "model": ("fixed " + str(self.fixed_costs)) if self.fixed_costs is not None
            else self.costs.describe(),
            "acceptance_scale": round(self.scale, 3),
            "probe_every": self.probe_every,
            "rounds": s.rounds, "all_zero_rounds": s.all_zero_rounds,
            "whole_rounds": s.whole_rounds,
            "drafted_nodes": s.drafted_nodes, "kept_nodes": s.kept_nodes,
            "kept_histogram": {str(k): v for k, v in sorted(s.kept_histogram.items())},
        }


def _forget_into(values: list[float | None], nodes: list[float | None],
                 per_value: np.ndarray, per_nodes: np.ndarray) -> None:
    """Blend one round's per-depth value and nodes per request into the tables (index
    ``d - 1``; grown with None for depths never drafted), forgetting by
    :data:`DEPTH_FORGETTING`; a depth whose round value is NaN (nobody drafted it) is left
    as it was."""
    while len(values) < len(per_value):
        values.append(None)
        nodes.append(None)
    a = DEPTH_FORGETTING
    for i, (per_v, per_n) in enumerate(zip(per_value.tolist(), per_nodes.tolist())):
        if per_v != per_v:  # NaN
            continue
        old_v, old_n = values[i], nodes[i]
        values[i] = per_v if old_v is None else a * old_v + (1 - a) * per_v
        nodes[i] = per_n if old_n is None else a * old_n + (1 - a) * per_n


def requests_that_may_draft(proposer: Any, req_ids: Sequence[str]) -> int:
    """How many of ``req_ids`` are not :func:`retired_requests`: what the tree control's
    depth choice weighs."""
    retired = retired_requests(proposer)
    return sum(rid not in retired for rid in req_ids)


def apply_keep(tokens: torch.Tensor, parents: torch.Tensor, keep: np.ndarray
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request's BFS tree cut to its kept nodes (a rooted subtree): the kept tokens,
    their parents re-indexed among the kept nodes, and the kept nodes' old indices. A
    subsequence of a BFS order whose parents are kept stays a BFS order."""
    idx = torch.as_tensor(np.flatnonzero(keep), dtype=torch.int64)
    new_index = torch.full((parents.shape[0] + 1,), -1, dtype=torch.int64)
    new_index[idx + 1] = torch.arange(idx.numel(), dtype=torch.int64)
    par = parents.to("cpu", torch.int64)[idx]
    if bool((par >= 0).any()) and bool((new_index[par[par >= 0] + 1] < 0).any()):
        raise AssertionError("tree cost control: a kept node's parent was pruned")
    return tokens[idx.to(tokens.device)], new_index[par + 1], idx


def tree_cost_stats(proposer: Any, stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` (a tree drafter's ``specx_stats()`` for ``vllm-specx bench``) with the
    tree control's model and prunings under ``"tree_cost_control"`` where it ran; the
    EAGLE/MTP head trees and the ``adaptive`` draft-model tree report alike (as the chain
    drafters do through ``cost_model.cost_control_stats``)."""
    control = getattr(proposer, "_tree_cost", None)
    if control is not None:
        stats["tree_cost_control"] = control.describe()
        holes = getattr(proposer, "_kv_holes", None)
        if holes is not None:  # a head tree's depth-0 rounds skip the first pass
            stats["tree_cost_control"]["idle_first_pass"] = holes.as_dict()
    return stats


def tree_cost_control_for(proposer: Any) -> TreeCostControl | None:
    """The proposer's tree control when its settings turn ``cost_control`` on (made once,
    kept on the proposer as ``_tree_cost``), else None. Off under tensor or pipeline
    parallelism: every rank must draft the same trees, and each rank's clock differs."""
    if not cost_control_applies(proposer):
        return None
    control = getattr(proposer, "_tree_cost", None)
    if control is None:
        control = proposer._tree_cost = TreeCostControl(clock=engine_step_clock(),
                                                          refit_every=REFIT_EVERY)
    return control
