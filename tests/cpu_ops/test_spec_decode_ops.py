"""Speculative-decoding and block-table kernels vs. direct Python loops.

Each case runs through vLLM's own launch path (the Triton-kernel stand-ins the CPU
platform registers, its adapters, then our ``_C`` ops), on ragged batches with
int32 buffers as vLLM allocates them.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("reference_ops")

PLACEHOLDER = -1


def _ragged(num_draft, vocab, seed, *, agree=0.6):
    """Random drafts with a target that agrees with the draft ~``agree`` of the time."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(num_draft)
    draft = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    target = torch.where(
        torch.rand(n, generator=gen) < agree,
        draft.long(),
        torch.randint(0, vocab, (n,), generator=gen),
    )
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    bonus = torch.randint(0, vocab, (len(num_draft), 1), generator=gen)
    return gen, draft, target, cu, bonus


def _loop_accept(num_draft, tokens_if_accepted, accept, replacement, bonus, rows, width):
    out = [[PLACEHOLDER] * width for _ in num_draft]
    start = 0
    for r, n in enumerate(num_draft):
        if rows[r]:
            rejected = False
            for p in range(n):
                if accept[start + p]:
                    out[r][p] = tokens_if_accepted[start + p]
                else:
                    out[r][p] = replacement[start + p]
                    rejected = True
                    break
            if not rejected:
                out[r][n] = bonus[r]
        start += n
    return out


@pytest.mark.parametrize("with_is_greedy", [False, True])
def test_rejection_greedy(with_is_greedy: bool):
    from vllm.v1.sample.rejection_sampler import _rejection_greedy_sample

    num_draft = [3, 0, 5, 1, 4, 2]
    max_spec = 5
    _, draft, target, cu, bonus = _ragged(num_draft, 50, seed=1)
    is_greedy = torch.tensor([True, True, False, True, False, True]) if with_is_greedy else None
    out = torch.full((len(num_draft), max_spec + 1), PLACEHOLDER, dtype=torch.int32)
    _rejection_greedy_sample(out, cu, draft, target, bonus, is_greedy, max_spec, None, None)
    rows = [True] * len(num_draft) if is_greedy is None else is_greedy.tolist()
    accept = (draft.long() == target).tolist()
    want = _loop_accept(
        num_draft,
        target.tolist(),
        accept,
        target.tolist(),
        bonus.view(-1).tolist(),
        rows,
        max_spec + 1,
    )
    assert out.tolist() == want


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rejection_random_and_recovered(with_draft_probs: bool):
    from vllm.v1.sample.rejection_sampler import (
        _rejection_random_sample,
        _sample_recovered_tokens,
    )

    num_draft = [4, 2, 0, 3, 5]
    vocab, max_spec = 40, 5
    gen, draft, _, cu, bonus = _ragged(num_draft, vocab, seed=2)
    n = draft.shape[0]
    target_logits = torch.randn(n, vocab, generator=gen) * 2
    # Make the target like the draft token at every other position, so that both the
    # accept and the reject paths run with and without draft probabilities.
    boost = torch.arange(n) % 2 == 0
    target_logits[boost, draft[boost].long()] += 6.0
    target_probs = torch.softmax(target_logits, dim=-1)
    draft_probs = (
        torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
        if with_draft_probs
        else None
    )
    draft[3] = -1  # a padded draft id is always rejected
    uniform = torch.rand(n, generator=gen, dtype=torch.float64)
    inv_q = torch.empty(len(num_draft), vocab).exponential_(generator=gen).reciprocal()
    is_greedy = torch.tensor([False, True, False, False, False])

    recovered = torch.empty_like(draft)
    _sample_recovered_tokens(
        recovered, cu, draft, draft_probs, target_probs, inv_q, max_spec_len=max_spec
    )
    req_of = [r for r, k in enumerate(num_draft) for _ in range(k)]
    want_recovered = []
    for t in range(n):
        if draft_probs is None:
            resid = target_probs[t].clone()
            if draft[t] >= 0:
                resid[draft[t]] = 0
        else:
            resid = (target_probs[t] - draft_probs[t]).clamp_min(0)
        want_recovered.append(int((resid * inv_q[req_of[t]]).argmax()))
    assert recovered.tolist() == want_recovered

    out = torch.full((len(num_draft), max_spec + 1), PLACEHOLDER, dtype=torch.int32)
    _rejection_random_sample(
        out,
        cu,
        draft,
        draft_probs,
        target_probs,
        bonus,
        recovered,
        uniform,
        is_greedy,
        max_spec,
        None,
    )
    accept = []
    for t in range(n):
        d = int(draft[t])
        if d < 0:
            accept.append(False)
            continue
        p_d = 1.0 if draft_probs is None else float(draft_probs[t, d])
        # fp32 probabilities, as the op receives them
        accept.append(p_d > 0 and float(target_probs[t, d]) / p_d >= float(uniform[t].float()))
    want = _loop_accept(
        num_draft,
        draft.tolist(),
        accept,
        recovered.tolist(),
        bonus.view(-1).tolist(),
        (~is_greedy).tolist(),
        max_spec + 1,
    )
    assert out.tolist() == want
    assert any(a for a in accept) and not all(accept)  # both paths exercised


@pytest.mark.parametrize(
    "values,replace",
    [
        (torch.tensor([0.7, -1.0, 1.3], dtype=torch.float32), (-1, 1)),  # temperatures
        (torch.tensor([5, 0, 9], dtype=torch.int32), (0, 0)),  # top-k
        (torch.tensor([0.9, 1.0, 0.5], dtype=torch.float32), (0, 0)),  # top-p
    ],
)
def test_expand_batch_to_tokens_keeps_dtype(values, replace):
    """vLLM 0.32.0's own adapter loses float32/int32 outputs (defect 2)."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    cu = torch.tensor([2, 2, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(values, cu, 6, replace_from=replace[0], replace_to=replace[1])
    vals = [replace[1] if float(v) == replace[0] else v.item() for v in values]
    want = [vals[0]] * 2 + [vals[2]] * 4
    assert got.dtype == values.dtype
    torch.testing.assert_close(got, torch.tensor(want, dtype=values.dtype))


def test_compute_slot_mapping_kernel_via_block_table():
    """vLLM 0.32.0's own adapter crashes here (defect 1)."""
    from vllm.v1.worker.block_table import _COMPUTE_SLOT_MAPPING_KERNEL

    block_size, max_tokens = 32, 200
    q_lens = [40, 1, 70, 3]
    starts = [0, 64, 5, 100]  # tokens already computed per request
    block_table = torch.randint(0, 1000, (6, 8), dtype=torch.int32)  # more rows than reqs
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
    slot_mapping = torch.full((max_tokens,), 12345, dtype=torch.int64)
    _COMPUTE_SLOT_MAPPING_KERNEL(
        len(q_lens),
        positions.shape[0],
        max_tokens,
        qsl,
        positions,
        block_table,
        block_table.stride(0),
        slot_mapping,
        block_size,
        1,
        0,
        1,
    )
    want = []
    for r, (s, q) in enumerate(zip(starts, q_lens)):
        for p in range(s, s + q):
            want.append(int(block_table[r, p // block_size]) * block_size + p % block_size)
    want += [-1] * (max_tokens - len(want))  # padding slots
    assert slot_mapping.tolist() == want


def test_compute_slot_mapping_op_direct():
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    positions = torch.tensor([0, 31, 32, 7, 8])
    block_table = torch.tensor([[4, 9], [2, 0]], dtype=torch.int32)
    slot_mapping = torch.zeros(5, dtype=torch.int64)
    torch.ops._C.compute_slot_mapping_kernel_impl(qsl, positions, block_table, slot_mapping, 32)
    assert slot_mapping.tolist() == [128, 159, 288, 71, 72]


def test_eagle_prepare_inputs_padded():
    from vllm.v1.spec_decode.utils import _eagle_prepare_inputs_padded

    num_draft = [3, 0, 2, 4]
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    valid = torch.tensor([2, 1, 3, 1], dtype=torch.int32)
    q_lens = [4, 1, 3, 5]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    idx = torch.empty(4, dtype=torch.int32)
    rejected = torch.empty(4, dtype=torch.int32)
    _eagle_prepare_inputs_padded(cu, valid, qsl, idx, rejected, 4)
    want_rej = [n + 1 - int(v) if n > 0 else 0 for n, v in zip(num_draft, valid)]
    assert rejected.tolist() == want_rej
    assert idx.tolist() == [int(qsl[r + 1]) - 1 - want_rej[r] for r in range(4)]


def test_eagle_prepare_next_token_padded():
    from vllm.v1.spec_decode.utils import _eagle_prepare_next_token_padded

    vocab = 100
    sampled = torch.tensor(
        [[5, 6, -1, -1], [-1, -1, -1, -1], [7, 8, 9, 10], [11, 150, -1, -1], [1, 2, 3, 4]],
        dtype=torch.int32,
    )
    discard = torch.tensor([False, False, False, False, True])
    backup = torch.tensor([50, 51, 52, 53, 54], dtype=torch.int32)
    nxt = torch.empty(5, dtype=torch.int32)
    count = torch.empty(5, dtype=torch.int32)
    _eagle_prepare_next_token_padded(
        sampled, discard, backup, nxt, count, vocab, 4, 5, sampled.stride(0), BLOCK_SIZE_TOKENS=4
    )
    want_n, want_c = [], []
    for r in range(5):
        valid = [t for t in sampled[r].tolist() if t != -1 and t < vocab]
        if discard[r]:
            want_n.append(int(backup[r]))
            want_c.append(0)
        else:
            want_n.append(valid[-1] if valid else int(backup[r]))
            want_c.append(len(valid))
    assert nxt.tolist() == want_n
    assert count.tolist() == want_c


def test_specx_next_token_ids_after_a_step_without_drafts_equal_the_kernels():
    """SpecxPasses.prepare_next_token_ids_padded's host path for one sampled column (a
    step where cost control drafted nothing) against vLLM's method with its kernel: valid
    tokens, a rejected (-1) row, an out-of-vocabulary row and discarded rows (prompt
    chunks), which take the request's backup token."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.utils import CpuGpuBuffer

    from vllm_specx.glue.draft_passes import SpecxPasses

    vocab, n = 100, 6
    sampled = torch.tensor([[5], [-1], [7], [150], [9], [3]], dtype=torch.int32)
    discard_buf = torch.zeros(8, dtype=torch.bool)  # vLLM's buffer is max_num_reqs long
    discard_buf[4] = True
    discard_buf[5] = True
    history = {f"r{i}": [60 + 10 * i + j for j in range(12)] for i in range(n)}
    requests = {rid: SimpleNamespace(get_token_id=toks.__getitem__)
                for rid, toks in history.items()}
    batch = SimpleNamespace(num_reqs=n, req_ids=list(history), vocab_size=vocab,
                            num_tokens_no_spec=[3, 4, 5, 6, 7, 8])
    proposer = object.__new__(SpecxPasses)
    proposer.backup_next_token_ids = CpuGpuBuffer(8, dtype=torch.int32, device="cpu",
                                                  pin_memory=False)
    want = SpecDecodeBaseProposer.prepare_next_token_ids_padded(
        proposer, sampled, requests, batch, discard_buf)
    got = proposer.prepare_next_token_ids_padded(sampled, requests, batch, discard_buf)
    assert got[0].tolist() == want[0].tolist() == [5, 73, 7, 95, 106, 117]
    assert got[1].tolist() == want[1].tolist() == [1, 0, 1, 0, 0, 0]
    assert got[0].dtype == got[1].dtype == torch.int32
    assert sampled[:, 0].tolist() == [5, -1, 7, 150, 9, 3]  # the sampled ids untouched


def test_eagle_step_slot_mapping_with_padding():
    from vllm.v1.spec_decode.utils import eagle_step_update_slot_mapping_and_metadata

    block_size, max_len = 32, 100
    positions = torch.tensor([10, 31, 98, 99, 63])
    block_table = torch.randint(0, 500, (5, 4), dtype=torch.int32)
    seq_lens = torch.tensor([11, 32, 99, 100, 64], dtype=torch.int32)
    lens_before = seq_lens.tolist()
    out_pos = torch.empty(5, dtype=torch.int64)
    out_slots = torch.full((8,), 777, dtype=torch.int64)  # 3 cudagraph padding rows
    eagle_step_update_slot_mapping_and_metadata(
        positions, block_table, seq_lens, block_size, max_len, out_pos, out_slots, 8
    )
    want_pos, want_slots, want_lens = [], [], []
    for r in range(5):
        p = int(positions[r]) + 1
        over = p >= max_len
        cp = 0 if over else p
        blk = min(cp // block_size, 3)
        want_pos.append(cp)
        want_slots.append(-1 if over else int(block_table[r, blk]) * block_size + cp % block_size)
        want_lens.append(1 if over else min(lens_before[r] + 1, max_len))
    assert out_pos.tolist() == want_pos
    assert out_slots.tolist() == want_slots + [-1, -1, -1]
    assert seq_lens.tolist() == want_lens


@pytest.mark.parametrize("shift", [False, True])
def test_copy_and_expand_eagle_inputs(shift: bool):
    from vllm.v1.spec_decode.utils import _copy_and_expand_eagle_inputs

    q_lens = [4, 1, 3]
    n_rej = [1, 0, 2]  # tokens rejected last step, at the end of each request's run
    pad, par_tok, n_slots = 0, 99, 3
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qel = (qsl[1:] - 1 - torch.tensor(n_rej)).to(torch.int32)
    total_in = int(qsl[-1])
    ids = torch.arange(10, 10 + total_in, dtype=torch.int32)
    pos = torch.cat([torch.arange(20, 24), torch.arange(7, 8), torch.arange(50, 53)])
    nxt = torch.tensor([71, 72, 73], dtype=torch.int32)
    extra = n_slots - 1 if shift else n_slots
    total_out = total_in + extra * 3
    out_ids = torch.full((total_out + 2,), -5, dtype=torch.int32)
    out_pos = torch.full((total_out + 2,), -5, dtype=torch.int64)
    rej_mask = torch.zeros(total_out + 2, dtype=torch.bool)
    msk_mask = torch.zeros(total_out + 2, dtype=torch.bool)
    new_idx = torch.full((3 * n_slots,), -5, dtype=torch.int32)
    hidden_map = torch.full((total_in,), -5, dtype=torch.int32)
    _copy_and_expand_eagle_inputs(
        target_token_ids_ptr=ids,
        target_positions_ptr=pos,
        next_token_ids_ptr=nxt,
        out_input_ids_ptr=out_ids,
        out_positions_ptr=out_pos,
        out_is_rejected_token_mask_ptr=rej_mask,
        out_is_masked_token_mask_ptr=msk_mask,
        out_new_token_indices_ptr=new_idx,
        out_hidden_state_mapping_ptr=hidden_map,
        query_start_loc_ptr=qsl,
        query_end_loc_ptr=qel,
        padding_token_id=pad,
        parallel_drafting_token_id=par_tok,
        total_input_tokens=total_in,
        num_padding_slots_per_request=n_slots,
        shift_input_ids=shift,
        BLOCK_SIZE_TOKENS=8,
        batch_size=3,
        num_blocks=2,
    )
    w_ids, w_pos, w_rej, w_msk, w_new, w_map = [], [], [], [], [], {}
    for r in range(3):
        qs, qe, nqs = int(qsl[r]), int(qel[r]), int(qsl[r + 1])
        n_valid = qe - qs if shift else qe - qs + 1
        first = qs + 1 if shift else qs
        out_start = qs + r * extra
        for j in range(n_valid + n_slots + (nqs - qe - 1)):
            if j < n_valid:
                tok = int(ids[first + j])
            elif j == n_valid:
                tok = int(nxt[r])
            elif j < n_valid + n_slots:
                tok = par_tok
            else:
                tok = pad
            rej = j >= n_valid + n_slots
            w_ids.append(tok)
            w_pos.append(0 if rej else int(pos[qs]) + j)
            w_rej.append(rej)
            w_msk.append(n_valid < j < n_valid + n_slots)
            if n_valid <= j < n_valid + n_slots:
                w_new.append(out_start + j)
        if shift:
            for j in range(nqs - qs):
                w_map[qs + j] = out_start + j
    assert out_ids[:total_out].tolist() == w_ids
    assert out_ids[total_out:].tolist() == [-5, -5]  # nothing written past the runs
    assert out_pos[:total_out].tolist() == w_pos
    assert rej_mask[:total_out].tolist() == w_rej
    assert msk_mask[:total_out].tolist() == w_msk
    assert new_idx.tolist() == w_new
    if shift:
        assert hidden_map.tolist() == [w_map[i] for i in range(total_in)]


def _column(t: torch.Tensor | None) -> torch.Tensor | None:
    """``[N] -> [N, 1]``: same flat memory, another shape (vLLM's own tests pass these)."""
    return None if t is None else t.reshape(-1, 1)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_spec_decode_ops_read_flat_memory_like_the_compiled_ops(with_draft_probs: bool):
    """The compiled ops read 1-D inputs through their data pointer, so ``[N, 1]`` (or
    ``[B, 1]``) tensors work there; the reference ops must accept them too and give the
    answers of the flat shapes (vLLM's tests/v1/sample/test_rejection_sampler.py passes
    ``[N, 1]`` draft ids to ``sample_recovered_tokens``)."""
    ops = torch.ops._C
    num_draft = [3, 0, 2, 4]
    vocab, max_spec = 12, 4
    gen, draft, target_argmax, cu, bonus = _ragged(num_draft, vocab, seed=7)
    draft = draft.long()
    n, b = draft.shape[0], len(num_draft)
    target_probs = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, dim=-1)
    draft_probs = (
        torch.softmax(torch.randn(n, vocab, generator=gen), dim=-1) if with_draft_probs else None
    )
    inv_q = torch.empty(b, vocab).exponential_(generator=gen).reciprocal()
    uniform = torch.rand(n, generator=gen)
    is_greedy = torch.tensor([True, False, False, True])
    cu = cu.long()

    def run(shape):
        recovered = shape(torch.full((n,), -7, dtype=torch.int64))
        ops.sample_recovered_tokens_kernel_impl(
            recovered, shape(cu), shape(draft), draft_probs, target_probs, inv_q, vocab,
            not with_draft_probs,
        )  # fmt: skip
        greedy_out = torch.full((b, max_spec + 1), PLACEHOLDER, dtype=torch.int64)
        ops.rejection_greedy_sample_kernel_impl(
            greedy_out, shape(cu), shape(draft), shape(target_argmax), bonus,
            shape(is_greedy), max_spec,
        )  # fmt: skip
        random_out = torch.full((b, max_spec + 1), PLACEHOLDER, dtype=torch.int64)
        ops.rejection_random_sample_kernel_impl(
            random_out, shape(cu), shape(draft), draft_probs, target_probs, bonus,
            shape(recovered), shape(uniform), shape(is_greedy), max_spec, vocab,
            not with_draft_probs,
        )  # fmt: skip
        expanded = shape(torch.zeros(n, dtype=torch.int64))
        ops.expand_kernel_impl(expanded, shape(torch.arange(10, 10 + b)), shape(cu), 11, 99)
        return [x.reshape(-1).tolist() for x in (recovered, greedy_out, random_out, expanded)]

    flat = run(lambda t: t)
    assert flat[0] != [-7] * n and flat[3] == [10] * 3 + [12] * 2 + [13] * 4
    assert run(_column) == flat
