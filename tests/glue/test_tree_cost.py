"""glue/tree_cost.py without an engine: pruned trees stay valid BFS trees, the acceptance
scale follows the accepted paths, the drafted depth follows what deeper depths were worth
(engine tests: tests/eagle/test_eagle3_engine.py, tests/mtad/test_draft_model_tree_engine.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_specx.algorithms.draft_length import StepCosts
from vllm_specx.algorithms.tree_budget import node_depths
from vllm_specx.glue.tree_cost import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    TreeCostControl,
    apply_keep,
)


def _tree() -> tuple[torch.Tensor, torch.Tensor]:
    # BFS: 0, 1 children of the root; 2, 3 of node 0; 4 of node 2.
    return torch.tensor([-1, -1, 0, 0, 2]), torch.log(torch.tensor([0.9, 0.05, 0.6, 0.2, 0.5]))


def test_prune_keeps_a_bfs_subtree_with_reindexed_parents():
    parents, logq = _tree()
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.3, 0.0, 0.0)
    keep = control.prune(["a", "b"], [parents, torch.tensor([-1, 0])],
                         [logq, torch.log(torch.tensor([0.1, 0.05]))], passes=2, rows=4)
    assert keep[0].tolist() == [True, False, True, False, True]
    assert not keep[1].any()  # nothing pays: zero nodes
    tokens, new_parents, idx = apply_keep(torch.arange(10, 15), parents, keep[0])
    assert tokens.tolist() == [10, 12, 14] and new_parents.tolist() == [-1, 0, 1]
    assert idx.tolist() == [0, 2, 4]
    # Costlier nodes: fewer kept; free nodes: everything.
    control.fixed_costs = StepCosts(0.0, 1.0, 0.0, 0.0, 0.0)
    assert control.prune(["a"], [parents], [logq], 0, 0)[0].all()


def test_acceptance_scale_follows_accepted_paths():
    parents, logq = _tree()
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.0, 0.0, 0.0)
    assert control.scale == 1.0
    for _ in range(50):
        control.begin(["a"], torch.tensor([0]), None)  # no timing: nothing learnt
        keep = control.prune(["a"], [parents], [logq], 0, 0)
    assert control.scale == 1.0
    # Every kept node accepted each step (5 vs a predicted 2.25): the scale rises, capped.
    for _ in range(50):
        control.begin(["a"], torch.tensor([0]), 1 + int(keep[0].sum()))
        keep = control.prune(["a"], [parents], [logq], 0, 0)
    assert control.scale == 2.0
    for _ in range(200):  # nothing accepted: down to the floor
        control.begin(["a"], torch.tensor([int(keep[0].sum())]), 1 + int(keep[0].sum()))
        keep = control.prune(["a"], [parents], [logq], 0, 0)
    assert control.scale == 0.25


def _depth_one(parents: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The depth-1 nodes of a BFS tree (its first nodes, children of the root)."""
    n = int((parents < 0).sum())
    return parents[:n], logq[:n]


def _control_after_a_full_tree(costs: StepCosts) -> TreeCostControl:
    """A tree control with the fixed cost model ``costs`` that has pruned a whole
    :func:`_tree` (all three depths measured) for request "a"."""
    parents, logq = _tree()
    control = TreeCostControl()
    control.fixed_costs = costs
    control.prune(["a"], [parents], [logq], 2, 2)
    return control


def test_depths_are_measured_one_at_a_time():
    # Nothing measured: depth 1, not the full depth. Where every node pays, each next
    # depth (valued as the deepest measured one until drafted) is drafted in turn.
    parents, logq = _tree()
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.01, 0.0, 0.0)
    assert control.choose_depth(1, 3) == 1
    control.prune(["a"], *map(list, zip(_depth_one(parents, logq))), 1, 1)
    assert control.choose_depth(1, 3) == 2
    keep_two = node_depths(parents.numpy()) <= 2
    control.prune(["a"], [parents[keep_two]], [logq[keep_two]], 2, 2)
    assert control.choose_depth(1, 3) == 3
    control.prune(["a"], [parents], [logq], 2, 2)
    assert [control.choose_depth(1, 3) for _ in range(3 * PROBE_EVERY)] == [3] * 3 * PROBE_EVERY
    # Where depth 1 does not pay (a node costs ten steps), no deeper depth is drafted:
    # only depth 1 again, at the probes.
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 10.0, 1.0, 0.0)
    assert control.choose_depth(1, 3) == 1
    assert not control.prune(["a"], *map(list, zip(_depth_one(parents, logq))), 1, 1)[0].any()
    assert set(control.choose_depth(1, 3) for _ in range(3 * PROBE_EVERY)) == {0, 1}


def test_a_chosen_depth_that_no_kept_node_reached_is_measured_as_worth_nothing():
    # A dynamic tree keeps its best max_nodes nodes, which may all lie above the depth
    # drafted: that depth is then measured (worth nothing this round), so the control
    # does not draft it again and again to measure it.
    parents, logq = _tree()  # depths 1-3
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.01, 0.0, 0.0)
    control.prune(["a"], [parents], [logq], 2, 2)
    assert control.choose_depth(1, 4) == 4  # depth 4 not measured: it might pay
    control.prune(["a"], [parents], [logq], 3, 3)  # no node reached depth 4
    assert control._depth_value[3] == 0.0 and control._depth_nodes[3] == 0.0
    assert control.choose_depth(1, 4) == 3


def test_depth_follows_what_deeper_depths_were_worth():
    # A head pass costs as much as a whole step: only depth 1 pays once measured, and the
    # probes draft one depth deeper than that.
    control = _control_after_a_full_tree(StepCosts(0.0, 1.0, 0.01, 1.0, 0.0))
    depths = [control.choose_depth(1, 3) for _ in range(2 * PROBE_EVERY)]
    assert depths == ([1] * (PROBE_EVERY - 1) + [2]) * 2, depths
    control.fixed_costs = StepCosts(0.0, 1.0, 0.01, 0.0, 0.0)  # free passes: full depth
    assert control.choose_depth(1, 3) == 3


def test_probes_back_off_while_they_keep_nothing():
    # Nothing pays (a node costs ten steps): every probe (depth 1, one deeper than the
    # choice) is cut to nothing, so the rounds between probes double, 8 -> 16 -> 32 -> 64,
    # and stay at 64; a probe that keeps a node at its depth (cheap nodes again) brings
    # the usual 8 back. Reference: the rounds at which a probe is due, written out.
    parents, logq = _depth_one(*_tree())
    control = _control_after_a_full_tree(StepCosts(0.0, 1.0, 10.0, 1.0, 0.0))
    probes = []
    for i in range(1, 8 + 16 + 32 + 64 + 64 + 1):
        depth = control.choose_depth(1, 3)
        if depth:
            probes.append(i)
            assert depth == 1 and not control.prune(["a"], [parents], [logq], 1, 1)[0].any()
    assert probes == [8, 8 + 16, 8 + 16 + 32, 8 + 16 + 32 + 64, 8 + 16 + 32 + 64 + 64]
    assert control.probe_every == MAX_PROBE_EVERY == 64
    control.fixed_costs = StepCosts(0.0, 1.0, 0.01, 1.0, 0.0)  # nodes pay again
    while not control.choose_depth(1, 3):
        pass
    assert control.prune(["a"], [parents], [logq], 1, 1)[0].any()
    assert control.probe_every == PROBE_EVERY


def test_a_probe_that_keeps_nodes_only_above_its_depth_did_not_pay():
    # A node costs 0.7 of a step: only the first (q = 0.9) pays, so depth 1 is the choice
    # and a probe at depth 2 whose pruned tree keeps only that node doubles the wait.
    parents, logq = _tree()
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.7, 1.0, 0.0)
    assert control.prune(["a"], [parents], [logq], 0, 0)[0].tolist() == [True] + [False] * 4
    keep_two = node_depths(parents.numpy()) <= 2
    assert [control.choose_depth(1, 3) for _ in range(PROBE_EVERY)] == [1] * 7 + [2]
    keep = control.prune(["a"], [parents[keep_two]], [logq[keep_two]], 0, 0)[0]
    assert keep.tolist() == [True, False, False, False]
    assert control.probe_every == 2 * PROBE_EVERY


def test_retired_requests_keep_no_node_and_a_batch_of_them_drafts_no_depth():
    # A retired request (its head KV upkeep stopped) keeps nothing, even where every node
    # is free; the others are pruned as before. A batch with no request left that may
    # draft gets depth 0, probes included.
    parents, logq = _tree()
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.0, 0.0, 0.0)
    keep = control.prune(["a", "b"], [parents, parents], [logq, logq], 2, 4, retired={"b"})
    assert keep[0].all() and not keep[1].any()
    assert control.stats.kept_nodes == 5
    # What each depth was worth is learnt per request that may draft: as for "a" alone.
    alone = TreeCostControl()
    alone.fixed_costs = control.fixed_costs
    alone.prune(["a"], [parents], [logq], 2, 4)
    assert control._depth_value == alone._depth_value
    assert control._depth_nodes == alone._depth_nodes
    assert [control.choose_depth(0, 3) for _ in range(3 * PROBE_EVERY)] == [0] * 3 * PROBE_EVERY


def test_depth_zero_chosen_before_the_first_pass_pays_the_skip_debt():
    # Before the first pass (which depth 0 then skips) depth 0 also costs what a skipped
    # pass leaves to a catch-up: a debt that makes a plain step dearer than drafting tips
    # the choice to depth 1; after the first pass (paid either way) it does not count.
    control = _control_after_a_full_tree(
        StepCosts(0.0, 1.0, 1.0, 0.0, 0.0, draft_round=0.2))
    assert control.choose_depth(1, 3) == 0
    control.fixed_costs = StepCosts(0.0, 1.0, 1.0, 0.0, 0.0, draft_round=0.2, skip_debt=2.0)
    assert control.choose_depth(1, 3, skips_first_pass=True) == 1
    assert control.choose_depth(1, 3) == 0


def test_trees_verified_whole_learn_each_depth_from_their_accepted_paths():
    # Sampled i.i.d. children are verified whole at a depth chosen before drafting: the
    # control prunes nothing, times the next step over every node, and learns what each
    # depth was worth from how often the accepted paths reached it (not from q, and not
    # into the top-k trees' acceptance scale or depth table).
    control = TreeCostControl()
    control.fixed_costs = StepCosts(0.0, 1.0, 0.1, 0.0, 0.0)
    assert control.choose_depth(2, 3, whole=True) == 1  # nothing measured yet: depth 1
    control.verified_whole(["a", "b"], [2])
    assert control._last_total == 4
    stats = control.stats
    assert stats.whole_rounds == 1 and stats.kept_nodes == stats.drafted_nodes == 4
    assert control.describe()["whole_rounds"] == 1
    control.begin(["a", "b"], torch.tensor([1, 2]), 2 + 4)  # "a" accepted 1 node, "b" 0
    assert control._whole_value == [0.5] and control._whole_nodes == [2.0]
    assert control.scale == 1.0 and control._depth_value == []
    # Depth 2, not measured, is valued as depth 1 (2 + 2 tokens for 1 + 0.8 of a step
    # against 2 + 1 for 1 + 0.4): drafted next, and its paths reach no deeper than depth 1.
    assert control.choose_depth(2, 3, whole=True) == 2
    control.verified_whole(["a", "b"], [2, 2])
    control.begin(["a", "b"], torch.tensor([3, 4]), 2 + 8)
    assert control._whole_value == pytest.approx([0.5, 0.0])
    # Depth 1 pays, depth 2 adds nodes and nothing else (and depth 3, valued as depth 2,
    # nothing): depth 1 until the next probe, one depth deeper.
    depths = [control.choose_depth(2, 3, whole=True) for _ in range(PROBE_EVERY)]
    assert depths == [1] * (PROBE_EVERY - 1) + [2], depths
    # The probe's paths again reach no deeper than depth 1: depth 2 still does not pay,
    # so the next probe waits twice as long.
    control.verified_whole(["a", "b"], [2, 2])
    control.begin(["a", "b"], torch.tensor([4, 3]), 2 + 8)
    assert control.probe_every == 2 * PROBE_EVERY
    # A step that did not verify the whole trees (another node count) teaches nothing.
    before = list(control._whole_value)
    control.verified_whole(["a", "b"], [2, 2])
    control.begin(["a", "b"], torch.tensor([0, 0]), 2 + 5)
    assert control._whole_value == before


def test_tree_requests_arriving_where_no_sure_node_pays_retire_on_arrival():
    # As the chain control's (tests/glue/test_cost_model.py): after retire_after rounds
    # in a row that verified no node, a new request of a tree drafter retires on arrival
    # where not even one certainly accepted node would pay (its verification row and the
    # round's drafting cost against a plain step); where one would, or after a round that
    # kept a node, it is admitted.
    import types

    from vllm_specx.glue.draft_passes import DraftKVHoles

    holes = DraftKVHoles(block_size=16, prefix_caching=True)
    holes.retire_after = 3
    control = TreeCostControl()
    dear = StepCosts(0.0, 1.0, 2.0, 0.0, 0.0)  # a node costs two plain steps
    cheap = StepCosts(0.0, 1.0, 0.01, 0.0, 0.0)
    control.fixed_costs = dear
    drafter = types.SimpleNamespace(tree_state=object(), _tree_cost=control,
                                    _cost_control=None)
    parents, logq = _tree()
    for _ in range(2):
        control.skipped(["a"])
    holes.admit(drafter, ("a", "b"))
    assert holes.admitted == {"a", "b"} and not holes.retired
    assert not control.prune(["a"], [parents], [logq], 0, 0)[0].any()  # idle round 3
    assert not control.sure_node_pays(3) and control.retires_arrivals(3, 3)
    control.fixed_costs = cheap  # a sure node pays: admitted, nobody retires
    assert control.sure_node_pays(4)
    holes.admit(drafter, ("a", "b", "d"))
    assert "d" in holes.admitted and not holes.retired
    control.fixed_costs = dear  # none pays: the arrival retires, and the batch with it
    holes.admit(drafter, ("a", "b", "c"))
    assert holes.retired == {"a", "b", "c"}
    assert holes.retired_on_arrival == 1 and holes.retired_idle_batch == 2
    control.verified_whole(["d"], [2, 2])  # a round that verified nodes: not idle
    holes.admit(drafter, ("d", "e"))
    assert "e" in holes.admitted and holes.retired == {"a", "b", "c"}


def test_bench_report_prints_what_the_tree_control_kept():
    from vllm_specx.bench.report import markdown_table

    control = TreeCostControl(clock=lambda: 0.0)
    control.stats.rounds, control.stats.all_zero_rounds = 12, 5
    control.stats.drafted_nodes, control.stats.kept_nodes = 96, 17
    control.stats.kept_histogram.update({0: 5, 1: 4, 3: 3})
    report = {"configs": [{"name": "eagle3 tree", "method": "specx_eagle3",
                           "drafter_stats": {"tree_cost_control": control.describe()}}]}
    line = next(x for x in markdown_table(report).splitlines()
                if x.startswith("- tree cost control of eagle3 tree"))
    assert "kept 17 of 96 drafted nodes over 12 rounds (5 keeping none" in line
    assert "{'0': 5, '1': 4, '3': 3}" in line and "acceptance scale" in line
    assert "(prior, 0 steps)" in line  # nothing measured yet: the prior's model
    assert "first passes skipped" not in line
    # A head tree whose depth-0 rounds skipped the first pass says so, and what retired.
    described = {**control.describe(), "idle_first_pass": {
        "skipped_first_passes": 7, "catch_up_passes": 3, "catch_up_tokens": 11,
        "retired_requests": 2, "retired_on_arrival": 0, "retire_after": 48}}
    report["configs"][0]["drafter_stats"]["tree_cost_control"] = described
    line = next(x for x in markdown_table(report).splitlines()
                if x.startswith("- tree cost control of eagle3 tree"))
    assert ("; 7 first passes skipped (depth 0), 11 positions caught up, in 3 passes of "
            "their own") in line
    # A draft model on V1 feeds most holes inside its next first passes.
    described["idle_first_pass"]["merged_catch_ups"] = 4
    line = next(x for x in markdown_table(report).splitlines()
                if x.startswith("- tree cost control of eagle3 tree"))
    assert "11 positions caught up, in 4 first passes, in 3 passes of their own" in line
    assert "2 requests retired from drafting" in line
