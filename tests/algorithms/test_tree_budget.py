"""vllm_specx.algorithms.tree_budget against a brute force over every kept set."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_specx.algorithms.draft_length import StepCosts
from vllm_specx.algorithms.tree_budget import (
    _request_curve,
    calibrated_path_values,
    choose_tree_depth,
    monotone_path_values,
    prune_trees,
    step_costs_paid,
    step_costs_target,
)


def _random_tree(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    parents = np.array([int(rng.integers(-1, i)) for i in range(n)], dtype=np.int64)
    # Path values: a product of per-edge rates, so non-increasing along paths; some
    # ties on purpose (rates of exactly 1) to exercise the parent-first order.
    rates = np.where(rng.random(n) < 0.15, 1.0, rng.random(n))
    v = np.ones(n)
    for i, p in enumerate(parents):
        v[i] = rates[i] * (1.0 if p < 0 else v[p])
    return parents, v


def _valid(parents, keep, whole_groups) -> bool:
    for i, p in enumerate(parents):
        if keep[i] and p >= 0 and not keep[p]:
            return False
    if whole_groups:
        for node in [-1, *range(len(parents))]:
            if node >= 0 and not keep[node]:
                continue
            kids = [i for i, p in enumerate(parents) if p == node]
            if kids and len({bool(keep[k]) for k in kids}) > 1:
                return False
    return True


def _brute(parents, values, paid, target, whole_groups, max_nodes):
    sizes = [len(p) for p in parents]
    best = -1.0
    for bits in itertools.product([False, True], repeat=sum(sizes)):
        keep, at = [], 0
        for n in sizes:
            keep.append(np.array(bits[at:at + n], dtype=bool))
            at += n
        if not all(_valid(p, k, g) for p, k, g in zip(parents, keep, whole_groups)):
            continue
        s = sum(int(k.sum()) for k in keep)
        if max_nodes is not None and s > max_nodes:
            continue
        tokens = len(parents) + sum(float(v[k].sum()) for v, k in zip(values, keep))
        best = max(best, tokens / (paid + target(s)))
    return best


def _targets():
    # Linear (StepCosts-like), and the measured batch-8 tree curve's convex shape.
    yield lambda s: 1.0 + 0.2 * s
    yield lambda s: 1.0 + 0.05 * s + 0.01 * s * s
    yield lambda s: 1.0 if s == 0 else 1.3 + 0.02 * s  # a jump on any drafted token


@pytest.mark.parametrize("seed", range(12))
def test_prune_trees_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, 4))
    sizes = rng.integers(0, 5, size=num_reqs)
    sizes[0] = max(sizes[0], 1)
    trees = [_random_tree(rng, int(n)) for n in sizes]
    parents = [t[0] for t in trees]
    values = [t[1] for t in trees]
    for whole_groups in ([False] * num_reqs, [True] * num_reqs,
                         [bool(x) for x in rng.integers(0, 2, num_reqs)]):
        for target in _targets():
            for paid in (0.0, 0.4):
                for max_nodes in (None, 3):
                    got = prune_trees(parents, values, paid, target, whole_groups, max_nodes)
                    want = _brute(parents, values, paid, target, whole_groups, max_nodes)
                    assert got.rate == pytest.approx(want, rel=1e-12, abs=1e-12)
                    # The returned set is allowed and has the rate it claims.
                    for p, k, g in zip(parents, got.keep, whole_groups):
                        assert _valid(p, k, g)
                    s = sum(int(k.sum()) for k in got.keep)
                    assert s == got.total_nodes
                    assert max_nodes is None or s <= max_nodes
                    tokens = num_reqs + sum(float(v[k].sum())
                                            for v, k in zip(values, got.keep))
                    assert tokens / (paid + target(s)) == pytest.approx(got.rate)


def test_largest_values_equal_the_tree_knapsack() -> None:
    # The module doc's argument: with monotone values the best s nodes are the s largest.
    rng = np.random.default_rng(7)
    for _ in range(30):
        parents, v = _random_tree(rng, int(rng.integers(1, 9)))
        curve, _ = _request_curve(parents, v, whole_groups=False)
        top = np.concatenate([[0.0], np.cumsum(np.sort(v)[::-1])])
        np.testing.assert_allclose(curve, top, rtol=1e-12)


def test_cheap_target_keeps_all_and_costly_target_keeps_none() -> None:
    parents = [np.array([-1, 0, 0, 1]), np.array([-1, -1])]
    values = [np.array([0.9, 0.6, 0.5, 0.4]), np.array([0.7, 0.2])]
    everything = prune_trees(parents, values, 0.0, lambda s: 1.0 + 1e-3 * s)
    assert [k.tolist() for k in everything.keep] == [[True] * 4, [True] * 2]
    # At batch 8 a tree token costs about as much as a quarter of a plain forward: a
    # node worth 0.2 tokens is not worth it, one worth 0.9 is.
    some = prune_trees(parents, values, 0.0, lambda s: 1.0 + 0.25 * s)
    assert some.keep[0].tolist() == [True, False, False, False]
    assert some.keep[1].tolist() == [True, False]
    nothing = prune_trees(parents, values, 0.0, lambda s: 1.0 + 2.0 * s)
    assert nothing.total_nodes == 0 and nothing.rate == pytest.approx(2.0)


def test_whole_groups_keep_or_drop_all_iid_siblings() -> None:
    # Root with three i.i.d. children worth 0.8, 0.1, 0.1: by value only the first pays,
    # but the sampled rule needs the group whole; at this cost the group does not pay.
    parents = [np.array([-1, -1, -1])]
    values = [np.array([0.8, 0.1, 0.1])]
    target = lambda s: 1.0 + 0.5 * s  # noqa: E731
    free = prune_trees(parents, values, 0.0, target, [False])
    assert free.keep[0].tolist() == [True, False, False]
    grouped = prune_trees(parents, values, 0.0, target, [True])
    assert grouped.keep[0].tolist() == [False, False, False]


def test_calibration_is_made_monotone() -> None:
    parents = np.array([-1, 0, 1])
    v = monotone_path_values(parents, np.array([0.5, 0.7, 1.4]))
    assert v.tolist() == [0.5, 0.5, 0.5]
    cal = calibrated_path_values(parents, np.array([0.6, 0.3, 0.1]), 2.0)
    assert cal.tolist() == pytest.approx([1.0, 0.6, 0.2])


@pytest.mark.parametrize("seed", range(6))
def test_choose_tree_depth_matches_enumeration(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    d = int(rng.integers(1, 6))
    vals = np.sort(rng.random(d) * 3)[::-1]
    nodes = rng.integers(1, 9, size=d)
    passes = rng.random(d) * 0.3
    target = lambda s: 1.0 + 0.1 * s  # noqa: E731
    skip = float(rng.random() * 0.5) if seed % 2 else 0.0
    got = choose_tree_depth(vals, nodes, 4, 0.1, passes, target, skip_cost=skip)
    rates = [4 / (0.1 + skip + target(0))] + [
        (4 + vals[:k].sum()) / (0.1 + passes[:k].sum() + target(int(nodes[:k].sum())))
        for k in range(1, d + 1)
    ]
    assert rates[got] == pytest.approx(max(rates))
    assert got == int(np.argmax(np.round(rates, 12)))


def test_step_costs_adapters_agree_with_the_chain_model() -> None:
    # A chain is a tree: its pruned step time must be StepCosts.step_time of that chain.
    for verify_fixed in (0.0, 0.03):
        costs = StepCosts(target_base=1.0, target_per_request=0.1, target_per_token=0.05,
                          draft_pass=0.2, draft_row=0.01, fixed=0.3, draft_round=0.04,
                          verify_fixed=verify_fixed)
        for lengths in ([3, 1, 0], [1, 0, 0], [0, 0, 0]):
            target = step_costs_target(costs, len(lengths))
            # Passes after the first: depth 1 .. max - 1, each over the requests still
            # drafting.
            rows = sum(sum(n > d for n in lengths) for d in range(1, max(lengths)))
            paid = step_costs_paid(costs, any(lengths), max(max(lengths) - 1, 0), rows)
            assert paid + target(sum(lengths)) == pytest.approx(costs.step_time(lengths))
        # A drafted tree pruned to nothing does not pay the target's verification cost.
        paid = step_costs_paid(costs, True, 0, 0)
        assert paid + step_costs_target(costs, 3)(0) == pytest.approx(
            costs.step_time([0, 0, 0]) + costs.draft_round - verify_fixed)
