"""Beam-tail pass planning (vllm_specx.algorithms.beam_tails) against slow references.

The references are plain Python over one request at a time: sorted() on tuples, a loop
comparing tokens, and a loop filling passes.
"""

from __future__ import annotations

import pytest
import torch

from vllm_specx.algorithms.beam_draft import recompute_tail_cost
from vllm_specx.algorithms.beam_tails import (
    held_prefix_len,
    lexicographic_order,
    split_rows_by_token_budget,
    tail_feed_start,
)

# --------------------------------------------------------------------------------------
# Slow references
# --------------------------------------------------------------------------------------


def ref_order(tails: list[list[int]]) -> list[int]:
    """Beam indices sorted by their tails; ties keep beam order (sorted() is stable)."""
    return sorted(range(len(tails)), key=lambda b: tuple(tails[b]))


def ref_held_prefix(held: list[int], held_len: int, tail: list[int]) -> int:
    n = 0
    for i, token in enumerate(tail):
        if i >= held_len or held[i] != token:
            break
        n += 1
    return n


def ref_split(q_lens: list[int], budget: int) -> list[tuple[int, int]]:
    passes: list[list[int]] = []
    for row, n in enumerate(q_lens):
        if passes and sum(q_lens[r] for r in passes[-1]) + n <= budget:
            passes[-1].append(row)
        else:
            passes.append([row])
    return [(p[0], p[-1] + 1) for p in passes]


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


def test_lexicographic_order_sorts_tails_per_row():
    g = torch.Generator().manual_seed(0)
    tails = torch.randint(0, 3, (6, 5, 3), generator=g)
    order = lexicographic_order(tails)
    for r in range(6):
        rows = [tuple(tails[r, b].tolist()) for b in order[r].tolist()]
        assert rows == sorted(rows)
        assert sorted(order[r].tolist()) == list(range(5))


@pytest.mark.parametrize("seed", range(5))
def test_lexicographic_order_matches_reference_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    rows, beams, depth = 7, 6, int(torch.randint(1, 5, (1,), generator=g))
    tails = torch.randint(0, 3, (rows, beams, depth), generator=g)  # many equal tails
    order = lexicographic_order(tails)
    for r in range(rows):
        assert order[r].tolist() == ref_order(tails[r].tolist())


@pytest.mark.parametrize("seed", range(5))
def test_held_prefix_and_feed_start_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rows, width = 9, 5
    j = int(torch.randint(1, width + 1, (1,), generator=g))
    held = torch.randint(0, 3, (rows, width), generator=g)
    held_len = torch.randint(0, width + 1, (rows,), generator=g)
    # Tails that mostly share a prefix with what is held, with a random first difference.
    tails = held[:, :j].clone()
    flip = torch.rand(rows, j, generator=g) < 0.3
    tails[flip] = torch.randint(0, 3, (int(flip.sum()),), generator=g)

    got = held_prefix_len(held, held_len, tails)
    start = tail_feed_start(held, held_len, tails)
    for r in range(rows):
        ref = ref_held_prefix(held[r].tolist(), int(held_len[r]), tails[r].tolist())
        assert int(got[r]) == ref
        assert int(start[r]) == min(ref, j - 1)  # the last token is always fed
    assert tail_feed_start(held, held_len, tails, reuse=False).tolist() == [0] * rows


def test_feeding_beams_in_order_costs_what_the_reference_search_reuses():
    """Walk one round the way the drafter does: the reuse saves exactly what a slow
    replay of the slot contents says, and never reuses across a disagreement."""
    g = torch.Generator().manual_seed(3)
    rows, beams, k = 4, 3, 5
    held = torch.zeros(rows, k - 1, dtype=torch.int64)
    held_len = torch.zeros(rows, dtype=torch.int64)
    slots = [[] for _ in range(rows)]  # reference: what each request's slots hold
    fed_total = 0
    for depth in range(1, k):
        tails = torch.randint(0, 2, (rows, beams, depth), generator=g)
        order = lexicographic_order(tails)
        for i in range(beams):
            beam = tails[torch.arange(rows), order[:, i]]  # [rows, depth]
            start = tail_feed_start(held, held_len, beam)
            for r in range(rows):
                tail = beam[r].tolist()
                ref_start = min(ref_held_prefix(slots[r], len(slots[r]), tail), depth - 1)
                assert int(start[r]) == ref_start
                assert slots[r][:ref_start] == tail[:ref_start]  # reused KV is right
                slots[r] = tail
            fed_total += int((depth - start).sum())
            held[:, :depth] = beam
            held_len.fill_(depth)
    assert fed_total <= rows * recompute_tail_cost(beams, k)


@pytest.mark.parametrize("seed", range(6))
def test_split_rows_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(0, 12, (1,), generator=g))
    q_lens = torch.randint(1, 6, (rows,), generator=g)
    budget = int(torch.randint(1, 12, (1,), generator=g))
    got = split_rows_by_token_budget(q_lens, budget)
    assert got == ref_split(q_lens.tolist(), budget)
    # Every row exactly once, in order; no pass over budget unless it is one oversize row.
    assert [r for lo, hi in got for r in range(lo, hi)] == list(range(rows))
    for lo, hi in got:
        assert int(q_lens[lo:hi].sum()) <= budget or hi - lo == 1


def test_split_rows_edge_cases():
    assert split_rows_by_token_budget(torch.tensor([], dtype=torch.int64), 4) == []
    assert split_rows_by_token_budget(torch.tensor([2, 2, 2]), 4) == [(0, 2), (2, 3)]
    assert split_rows_by_token_budget(torch.tensor([9, 1, 1]), 4) == [(0, 1), (1, 3)]
    assert split_rows_by_token_budget(torch.tensor([1, 1, 1]), 100) == [(0, 3)]


# --------------------------------------------------------------------------------------
# Batched drafting: slots and spans
# --------------------------------------------------------------------------------------


def ref_span(k: int, block_size: int) -> int:
    """Most distinct blocks of positions P+1..P+K-1 over every offset of P+1 in a block."""
    if k <= 1:
        return 0
    return max(
        len({(start + i) // block_size for i in range(k - 1)}) for start in range(block_size)
    )


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 32])
def test_tail_span_blocks_is_the_worst_offset(block_size):
    from vllm_specx.algorithms.beam_tails import beam_tail_span_blocks

    for k in range(1, 20):
        assert beam_tail_span_blocks(k, block_size) == ref_span(k, block_size), k


def ref_assign(parents: list[int], parent_slots: list[int], beams: int) -> list[int]:
    """One row: each beam in order takes its parent's slot if still free; the others then
    take the free slots in increasing order."""
    slots: list[int | None] = []
    taken: set[int] = set()
    for p in parents:
        s = parent_slots[p]
        if s not in taken:
            taken.add(s)
            slots.append(s)
        else:
            slots.append(None)
    free = [s for s in range(beams) if s not in taken]
    return [s if s is not None else free.pop(0) for s in slots]


def test_assign_beam_slots_matches_reference_and_is_a_permutation():
    from vllm_specx.algorithms.beam_tails import assign_beam_slots

    g = torch.Generator().manual_seed(0)
    for beams in (1, 2, 3, 4, 8):
        rows = 6
        parents = torch.randint(0, beams, (rows, beams), generator=g)
        parent_slots = torch.stack([torch.randperm(beams, generator=g) for _ in range(rows)])
        got = assign_beam_slots(parents, parent_slots)
        for r in range(rows):
            want = ref_assign(parents[r].tolist(), parent_slots[r].tolist(), beams)
            assert got[r].tolist() == want
            assert sorted(want) == list(range(beams))
    # The first step: one empty beam in slot 0, B children -> slots 0..B-1 in order.
    zeros = torch.zeros(2, 4, dtype=torch.long)
    first = assign_beam_slots(zeros, zeros[:, :1])
    assert first.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
