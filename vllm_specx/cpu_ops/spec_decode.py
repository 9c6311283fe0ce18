"""Speculative-decoding and block-table ops of vLLM's CPU build, vectorised.

Each op mirrors one Triton kernel in vLLM (``v1/sample/rejection_sampler.py``,
``v1/spec_decode/utils.py``, ``v1/worker/block_table.py``); the C++ CPU build exposes
them as ``_C::<kernel>_impl`` and vLLM's ``cpu_triton_utils`` adapters call them.
Conventions shared by the kernels:

* ``cu_num_draft_tokens`` is an *inclusive* cumulative sum, one entry per request;
* draft/target token arrays are flat over all draft tokens of the batch;
* outputs are written in place with ``copy_``-style casts, so the ops accept the int32
  buffers vLLM allocates as well as the int64 copies its adapters make;
* per-token and per-request arrays are read as flat memory, as the compiled ops read
  them through their data pointer: an ``[N, 1]`` tensor works like ``[N]`` (vLLM's own
  tests pass such shapes). :func:`_flat_arrays` gives each op flat views of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_Op = TypeVar("_Op", bound=Callable[..., None])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``t`` sharing its memory, so in-place writes reach the caller.

    Multi-dimensional tensors must be contiguous, as the compiled op assumes when it
    walks their data pointer (``view`` raises otherwise rather than copying silently).
    """
    return t if t.ndim == 1 else t.view(-1)


def _flat_arrays(*names: str) -> Callable[[_Op], _Op]:
    """Decorator: pass the named tensor arguments (None allowed) as flat views."""

    def wrap(op: _Op) -> _Op:
        signature = inspect.signature(op)

        @functools.wraps(op)
        def flat_op(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            for name in names:
                value = bound.arguments.get(name)
                if isinstance(value, torch.Tensor):
                    bound.arguments[name] = _flat(value)
            op(*bound.args, **bound.kwargs)

        return flat_op  # type: ignore[return-value]

    return wrap


def _first_column(per_request: torch.Tensor) -> torch.Tensor:
    """``[B]`` or ``[B, k]`` per-request ids -> ``[B]``: element ``r * stride(0)``, as the
    compiled op reads ``bonus_token_ids`` (vLLM passes ``[B, 1]``)."""
    return (
        per_request
        if per_request.ndim == 1
        else per_request.reshape(per_request.shape[0], -1)[:, 0]
    )


def _starts_and_counts(cu_inclusive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cu = cu_inclusive.to(torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    return starts, cu - starts


def _padded(
    values: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int, fill: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather a flat ragged array into ``[reqs, width]`` plus its validity mask."""
    cols = torch.arange(width)
    valid = cols[None, :] < counts[:, None]
    idx = (starts[:, None] + cols[None, :]).clamp(max=max(values.shape[0] - 1, 0))
    if values.shape[0] == 0:
        return torch.full((starts.shape[0], width), fill, dtype=torch.int64), valid
    out = torch.where(valid, values.to(torch.int64)[idx], fill)
    return out, valid


def _first_true(mask: torch.Tensor, default: torch.Tensor) -> torch.Tensor:
    """Column of the first True per row, or ``default`` where a row has none."""
    width = mask.shape[1]
    if width == 0:
        return default
    cols = torch.arange(width).expand_as(mask)
    firsts = torch.where(mask, cols, width).amin(dim=1)
    return torch.where(firsts < width, firsts, default)


def _write_rows(
    output: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    values: torch.Tensor,
) -> None:
    if rows.numel():
        output[rows, cols] = values.to(output.dtype)


def _emit_accepted_prefix(
    output_token_ids: torch.Tensor,
    active: torch.Tensor,
    counts: torch.Tensor,
    accepted: torch.Tensor,
    accepted_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    bonus: torch.Tensor,
) -> None:
    """Shared tail of both rejection samplers, for the ``active`` requests.

    Position ``p < first_rejection`` gets the accepted token, the first rejected
    position gets its replacement, and a request with no rejection gets its bonus
    token at position ``num_draft_tokens``. Later positions are left untouched.
    """
    width = accepted.shape[1]
    cols = torch.arange(width)
    first_rej = _first_true(~accepted & (cols[None, :] < counts[:, None]), counts)
    keep = active[:, None] & (cols[None, :] < first_rej[:, None])
    r, c = keep.nonzero(as_tuple=True)
    _write_rows(output_token_ids, r, c, accepted_tokens[r, c])
    rej = active & (first_rej < counts)
    r = rej.nonzero().squeeze(1)
    _write_rows(output_token_ids, r, first_rej[r], rejected_tokens[r, first_rej[r]])
    full = active & (first_rej >= counts)
    r = full.nonzero().squeeze(1)
    _write_rows(output_token_ids, r, counts[r], bonus[r])


@_flat_arrays("cu_num_draft_tokens", "draft_token_ids", "target_argmax", "is_greedy")
def rejection_greedy_sample_kernel_impl(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor | None,
    max_spec_len: int,
) -> None:
    """Greedy verification: accept drafts while they equal the target argmax; the
    first mismatch is replaced by the target's token. ``is_greedy=None`` means every
    request is greedy; non-greedy requests are left for the random sampler."""
    starts, counts = _starts_and_counts(cu_num_draft_tokens)
    num_reqs = counts.shape[0]
    width = max(int(counts.max()) if num_reqs else 0, 0)
    draft, valid = _padded(draft_token_ids, starts, counts, width, -1)
    target, _ = _padded(target_argmax, starts, counts, width, -1)
    active = (
        torch.ones(num_reqs, dtype=torch.bool)
        if is_greedy is None
        else is_greedy[:num_reqs].to(torch.bool)
    )
    accepted = (draft == target) & valid
    bonus = _first_column(bonus_token_ids)[:num_reqs].to(torch.int64)
    # Accepted positions emit the target token, which equals the draft there.
    _emit_accepted_prefix(output_token_ids, active, counts, accepted, target, target, bonus)


@_flat_arrays(
    "cu_num_draft_tokens", "draft_token_ids", "recovered_token_ids", "uniform_probs", "is_greedy"
)
def rejection_random_sample_kernel_impl(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    recovered_token_ids: torch.Tensor,
    uniform_probs: torch.Tensor,
    is_greedy: torch.Tensor | None,
    max_spec_len: int,
    vocab_size: int,
    no_draft_probs: bool,
) -> None:
    """Speculative sampling for non-greedy requests: draft token ``d`` at a position
    is accepted when ``p_target(d) / p_draft(d) >= u`` (``p_draft = 1`` without draft
    probs; a zero draft probability or a negative padded draft id rejects); the first
    rejected position takes the recovered token."""
    starts, counts = _starts_and_counts(cu_num_draft_tokens)
    num_reqs = counts.shape[0]
    width = max(int(counts.max()) if num_reqs else 0, 0)
    draft, valid = _padded(draft_token_ids, starts, counts, width, -1)
    recovered, _ = _padded(recovered_token_ids, starts, counts, width, -1)
    active = (
        torch.ones(num_reqs, dtype=torch.bool)
        if is_greedy is None
        else ~is_greedy[:num_reqs].to(torch.bool)
    )
    n_tok = draft_token_ids.shape[0]
    flat_draft = draft_token_ids[:n_tok].to(torch.int64)
    safe = flat_draft.clamp(0, target_probs.shape[1] - 1)
    rows = torch.arange(n_tok)
    p_t = target_probs[rows, safe].to(torch.float64)
    if no_draft_probs or draft_probs is None:
        p_d = torch.ones_like(p_t)
    else:
        p_d = draft_probs[rows, safe].to(torch.float64)
    u = uniform_probs[:n_tok].to(torch.float64)
    ok = (flat_draft >= 0) & (p_d > 0) & (p_t / torch.where(p_d > 0, p_d, 1.0) >= u)
    ok_pad, _ = _padded(ok.to(torch.int64), starts, counts, width, 0)
    accepted = ok_pad.bool() & valid
    bonus = _first_column(bonus_token_ids)[:num_reqs].to(torch.int64)
    _emit_accepted_prefix(output_token_ids, active, counts, accepted, draft, recovered, bonus)


@_flat_arrays("output", "input", "cu_num_tokens")
def expand_kernel_impl(
    output: torch.Tensor,
    input: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: int,
    replace_to: int,
) -> None:
    """``output[start_r:end_r] = input[r]`` (with ``replace_from`` mapped to
    ``replace_to``), e.g. per-request temperatures expanded to per-draft-token."""
    _, counts = _starts_and_counts(cu_num_tokens)
    num_reqs = counts.shape[0]
    vals = input[:num_reqs]
    vals = torch.where(vals == replace_from, torch.as_tensor(replace_to, dtype=vals.dtype), vals)
    total = int(counts.sum())
    if total == 0:
        return
    # The runs are back to back from 0 (the cumulative sum is inclusive).
    idx = torch.repeat_interleave(torch.arange(num_reqs), counts)
    output[:total] = vals[idx].to(output.dtype)


@_flat_arrays("output_token_ids", "cu_num_draft_tokens", "draft_token_ids")
def sample_recovered_tokens_kernel_impl(
    output_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    inv_q: torch.Tensor,
    vocab_size: int,
    no_draft_probs: bool,
) -> None:
    """Token to emit where a draft is rejected: ``argmax_v max(p_t - p_d, 0)[v] *
    inv_q[r, v]`` (with ``p_d`` = one-hot of the draft token when there are no draft
    probabilities), i.e. a Gumbel/exponential-race sample from the residual."""
    _, counts = _starts_and_counts(cu_num_draft_tokens)
    n_tok = int(counts.sum())
    if n_tok == 0:
        return
    req = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    tok = torch.arange(n_tok)  # runs are back to back from 0 (inclusive cumsum)
    p_t = target_probs[tok, :vocab_size].to(torch.float64)
    if no_draft_probs or draft_probs is None:
        prob = p_t.clone()
        d = draft_token_ids[tok].to(torch.int64)
        in_vocab = (d >= 0) & (d < vocab_size)
        rows = in_vocab.nonzero().squeeze(1)
        prob[rows, d[rows]] = 0.0
    else:
        prob = (p_t - draft_probs[tok, :vocab_size].to(torch.float64)).clamp_min(0.0)
    score = prob * inv_q[req, :vocab_size].to(torch.float64)
    output_token_ids[tok] = score.argmax(dim=1).clamp(max=vocab_size - 1).to(output_token_ids.dtype)


@_flat_arrays(
    "cu_num_draft_tokens", "valid_sampled_tokens_count", "query_start_loc_gpu",
    "token_indices_to_sample", "num_rejected_tokens_gpu",
)  # fmt: skip
def eagle_prepare_inputs_padded_kernel_impl(
    cu_num_draft_tokens: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
    query_start_loc_gpu: torch.Tensor,
    token_indices_to_sample: torch.Tensor,
    num_rejected_tokens_gpu: torch.Tensor,
    num_reqs: int,
) -> None:
    """Per request: rejected = drafts + 1 - valid (0 without drafts), and the index of
    the token to sample = last query token - rejected."""
    _, drafts = _starts_and_counts(cu_num_draft_tokens[:num_reqs])
    valid = valid_sampled_tokens_count[:num_reqs].to(torch.int64)
    rejected = torch.where(drafts > 0, drafts + 1 - valid, 0)
    last = query_start_loc_gpu[1 : num_reqs + 1].to(torch.int64) - 1
    token_indices_to_sample[:num_reqs] = (last - rejected).to(token_indices_to_sample.dtype)
    num_rejected_tokens_gpu[:num_reqs] = rejected.to(num_rejected_tokens_gpu.dtype)


@_flat_arrays(
    "discard_request_mask", "backup_next_token_ids", "next_token_ids", "valid_sampled_tokens_count"
)
def eagle_prepare_next_token_padded_kernel_impl(
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    next_token_ids: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
    vocab_size: int,
    num_sampled_tokens_per_req: int,
    num_reqs: int,
) -> None:
    """Per request: count valid sampled tokens (not -1, below ``vocab_size``) and take
    the last valid one as the next token; discarded requests (and requests with no
    valid token) take the backup token, and discarded ones count 0."""
    toks = sampled_token_ids[:num_reqs, :num_sampled_tokens_per_req].to(torch.int64)
    is_valid = (toks != -1) & (toks < vocab_size)
    count = is_valid.sum(dim=1)
    cols = torch.arange(toks.shape[1])
    last_idx = torch.where(is_valid, cols, -1).amax(dim=1) if toks.shape[1] else count - 1
    last_tok = toks.gather(1, last_idx.clamp(min=0)[:, None]).squeeze(1)
    backup = backup_next_token_ids[:num_reqs].to(torch.int64)
    discard = discard_request_mask[:num_reqs].to(torch.bool)
    nxt = torch.where(discard | (count == 0), backup, last_tok)
    count = torch.where(discard, 0, count)
    next_token_ids[:num_reqs] = nxt.to(next_token_ids.dtype)
    valid_sampled_tokens_count[:num_reqs] = count.to(valid_sampled_tokens_count.dtype)


@_flat_arrays("positions", "seq_lens", "out_clamped_positions", "out_slot_mapping")
def eagle_step_slot_mapping_metadata_kernel_impl(
    positions: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out_clamped_positions: torch.Tensor,
    out_slot_mapping: torch.Tensor,
    block_size: int,
    max_model_len: int,
    PAD_ID: int,
) -> None:
    """One autoregressive drafting step: position + 1 (0 past ``max_model_len``), its
    KV slot (``PAD_ID`` past the limit), and ``seq_lens + 1`` (1 past the limit, at
    most ``max_model_len``). ``out_slot_mapping`` rows beyond the batch are padding
    and get ``PAD_ID``."""
    batch = positions.shape[0]
    new_pos = positions.to(torch.int64) + 1
    exceeds = new_pos >= max_model_len
    clamped = torch.where(exceeds, 0, new_pos)
    n_blocks = block_table.shape[1]
    block_no = (clamped // block_size).clamp(max=n_blocks - 1)
    block_id = block_table[torch.arange(batch), block_no].to(torch.int64)
    slot = torch.where(exceeds, PAD_ID, block_id * block_size + clamped % block_size)
    new_len = torch.where(exceeds, 1, seq_lens[:batch].to(torch.int64) + 1)
    new_len = new_len.clamp(max=max_model_len)
    out_clamped_positions[:batch] = clamped.to(out_clamped_positions.dtype)
    out_slot_mapping[:batch] = slot.to(out_slot_mapping.dtype)
    out_slot_mapping[batch:] = PAD_ID
    seq_lens[:batch] = new_len.to(seq_lens.dtype)


@_flat_arrays(
    "target_token_ids", "target_positions", "next_token_ids", "out_input_ids", "out_positions",
    "out_is_rejected_token_mask", "out_is_masked_token_mask", "out_new_token_indices",
    "out_hidden_state_mapping", "query_start_loc", "query_end_loc",
)  # fmt: skip
def copy_and_expand_eagle_inputs_kernel_impl(
    target_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    next_token_ids: torch.Tensor,
    out_input_ids: torch.Tensor,
    out_positions: torch.Tensor,
    out_is_rejected_token_mask: torch.Tensor,
    out_is_masked_token_mask: torch.Tensor,
    out_new_token_indices: torch.Tensor,
    out_hidden_state_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_end_loc: torch.Tensor,
    padding_token_id: int,
    parallel_drafting_token_id: int,
    total_input_tokens: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool,
) -> None:
    """Lay out drafting inputs with extra slots per request (parallel drafting).

    Request ``r``'s output run holds: its valid input tokens (shifted by one when
    ``shift_input_ids``), the bonus token ``next_token_ids[r]``, then
    ``num_padding_slots_per_request - 1`` parallel-drafting slots, then one slot per
    token rejected last step. Positions count up from the request's first input
    position (0 for rejected slots). Also records where the new (bonus + parallel)
    tokens land and, when shifting, where each input's hidden state goes.
    """
    num_reqs = query_end_loc.shape[0]
    if num_reqs == 0:
        return
    n_pad = int(num_padding_slots_per_request)
    qs = query_start_loc[:num_reqs].to(torch.int64)
    nqs = query_start_loc[1 : num_reqs + 1].to(torch.int64)
    qe = query_end_loc[:num_reqs].to(torch.int64)
    reqs = torch.arange(num_reqs)
    if shift_input_ids:
        n_valid = qe - qs
        in_off = 1
        out_start = qs + reqs * (n_pad - 1)
    else:
        n_valid = qe - qs + 1
        in_off = 0
        out_start = qs + reqs * n_pad
    n_rejected = nqs - qe - 1
    n_out = n_valid + n_pad + n_rejected
    total = int(n_out.sum())
    req = torch.repeat_interleave(reqs, n_out)
    run_start = torch.cumsum(n_out, 0) - n_out
    j = torch.arange(total) - run_start[req]
    nv = n_valid[req]
    is_valid = j < nv
    is_bonus = j == nv
    is_parallel = (j > nv) & (j < nv + n_pad)
    is_rejected = j >= nv + n_pad
    in_idx = (qs[req] + in_off + j).clamp(max=total_input_tokens - 1)
    tokens = torch.where(is_valid, target_token_ids.to(torch.int64)[in_idx], 0)
    tokens = torch.where(is_bonus, next_token_ids.to(torch.int64)[req], tokens)
    tokens = torch.where(is_parallel, parallel_drafting_token_id, tokens)
    tokens = torch.where(is_rejected, padding_token_id, tokens)
    start_pos = target_positions.to(torch.int64)[qs]
    pos = torch.where(is_rejected, 0, start_pos[req] + j)
    out_idx = out_start[req] + j
    out_input_ids[out_idx] = tokens.to(out_input_ids.dtype)
    out_positions[out_idx] = pos.to(out_positions.dtype)
    out_is_rejected_token_mask[out_idx] = is_rejected.to(out_is_rejected_token_mask.dtype)
    out_is_masked_token_mask[out_idx] = is_parallel.to(out_is_masked_token_mask.dtype)
    is_new = (j >= nv) & (j < nv + n_pad)
    new_dst = req[is_new] * n_pad + (j[is_new] - nv[is_new])
    out_new_token_indices[new_dst] = out_idx[is_new].to(out_new_token_indices.dtype)
    if shift_input_ids:
        n_in = nqs - qs
        is_input = j < n_in[req]
        src = qs[req][is_input] + j[is_input]
        out_hidden_state_mapping[src] = out_idx[is_input].to(out_hidden_state_mapping.dtype)


@_flat_arrays("query_start_loc", "positions", "slot_mapping")
def compute_slot_mapping_kernel_impl(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """KV slot of every scheduled token: ``block_table[r, pos // bs] * bs + pos % bs``
    for token positions ``pos`` of request ``r`` (no context parallelism)."""
    qsl = query_start_loc.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]
    first, last = int(qsl[0]), int(qsl[-1])
    if last <= first:
        return
    req = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    pos = positions[first:last].to(torch.int64)
    blocks = block_table[req, pos // block_size].to(torch.int64)
    slot_mapping[first:last] = (blocks * block_size + pos % block_size).to(slot_mapping.dtype)
