"""``DraftKVHoles.first_pass_with_holes``: a draft model's first pass on V1 feeds each
request's hole (positions its skipped first passes did not write) in front of the
request's query, the way a chunked prefill would. Checked against a per-request
reference layout on vLLM's own ``CommonAttentionMetadata``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from vllm_specx.glue.draft_passes import DraftKVHoles

BLOCK = 4


def _step(query_lens: list[int], first_pos: list[int], padding: int = 0):
    """A target step: request ``i`` computes ``query_lens[i]`` tokens from position
    ``first_pos[i]``; ``padding`` tokens past the last query. Token ids encode
    (request, position) so that every token's origin can be read back."""
    n = len(query_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    tokens, positions = [], []
    for i, (q, p) in enumerate(zip(query_lens, first_pos)):
        tokens += [1000 * (i + 1) + p + j for j in range(q)]
        positions += [p + j for j in range(q)]
    tokens += [7] * padding
    positions += [0] * padding
    # Request i's blocks: 10 * (i + 1) + b, so a slot names its request and block.
    blocks = torch.tensor([[10 * (i + 1) + b for b in range(8)] for i in range(n)])
    slots = [int(blocks[i, pos // BLOCK]) * BLOCK + pos % BLOCK
             for i, (q, p) in enumerate(zip(query_lens, first_pos)) for pos in range(p, p + q)]
    seq_lens = torch.tensor([p + q for q, p in zip(query_lens, first_pos)], dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.copy()), query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=seq_lens, num_reqs=n, num_actual_tokens=int(qsl[-1]),
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
        block_table_tensor=blocks,
        slot_mapping=torch.tensor(slots + [PADDING_SLOT_ID] * padding, dtype=torch.int64),
    )
    committed = np.zeros((n, 64), dtype=np.int32)
    for i in range(n):
        committed[i] = 1000 * (i + 1) + np.arange(64)  # the same (request, position) code
    return (torch.tensor(tokens, dtype=torch.int32), torch.tensor(positions), cad, committed)


def test_holes_go_in_front_of_their_requests_queries():
    query_lens, first_pos = [1, 3, 1, 2], [9, 12, 20, 5]
    holes = {0: [5, 9], 2: [17, 20]}  # rows 1 and 3 have none
    token_ids, positions, cad, committed = _step(query_lens, first_pos, padding=2)
    proposer = SimpleNamespace(block_size=BLOCK)
    record = DraftKVHoles(BLOCK, prefix_caching=True)
    ids, pos, new = record.first_pass_with_holes(
        proposer, {r: list(v) for r, v in holes.items()}, committed, token_ids, positions, cad)

    # Reference: request by request, its hole then its query; the padding last.
    want_ids, want_pos, want_lens = [], [], []
    for i, (q, p) in enumerate(zip(query_lens, first_pos)):
        a = holes[i][0] if i in holes else p
        want_pos += list(range(a, p + q))
        want_ids += [1000 * (i + 1) + x for x in range(a, p + q)]
        want_lens.append(p + q - a)
    assert pos[: len(want_pos)].tolist() == want_pos
    assert ids[: len(want_ids)].tolist() == want_ids
    assert ids[len(want_ids):].tolist() == [7, 7]  # padding kept, after every query
    assert ids.dtype == torch.int32 and pos.dtype == positions.dtype
    assert new.query_start_loc_cpu.tolist() == np.concatenate(
        [[0], np.cumsum(want_lens)]).tolist()
    assert new.query_start_loc.tolist() == new.query_start_loc_cpu.tolist()
    assert new.num_actual_tokens == sum(want_lens) == cad.num_actual_tokens + 7
    assert new.max_query_len == max(want_lens) == 5
    # Sequence lengths and the block table are the step's: the holes lie inside them.
    assert new.seq_lens is cad.seq_lens and new.block_table_tensor is cad.block_table_tensor
    # Every slot is its token's: the request's block at position // BLOCK.
    for t, (tok, p) in enumerate(zip(ids[: len(want_ids)].tolist(), want_pos)):
        i = tok // 1000 - 1
        assert int(new.slot_mapping[t]) == (10 * (i + 1) + p // BLOCK) * BLOCK + p % BLOCK
    assert new.slot_mapping[len(want_ids):].tolist() == [PADDING_SLOT_ID] * 2


def test_the_cost_control_counts_the_holes_as_rows_of_the_first_pass():
    token_ids, positions, cad, committed = _step([1, 1], [6, 3])
    told: list[int] = []
    control = SimpleNamespace(costs=SimpleNamespace(merged_catch_up=told.append))
    proposer = SimpleNamespace(block_size=BLOCK, _cost_control=control)
    DraftKVHoles(BLOCK, prefix_caching=False).first_pass_with_holes(
        proposer, {1: [0, 3]}, committed, token_ids, positions, cad)
    assert told == [3]
