"""Triton kernels for :func:`vllm_specx.algorithms.verify.verify` (the ``cuda`` backend).

Two kernels, no Python loop over requests or tokens, no host synchronisation:

* ``token_accept`` (one program per draft token): the per-token decision. Greedy
  requests: is the draft the batch's ``target_argmax``? ``standard``: the
  ``u * q(x) < p(x)`` test (``u < p(x)`` for a one-hot drafter). ``mtad``: the term
  ``log p(x) - log q(x)`` (``-inf`` for zero or invalid). Token-parallel, because a
  greedy check reads a whole vocabulary row and requests are short.
* ``finish`` (one program per request): scans its drafts for the accepted length
  (first rejection, or MTAD's largest passing depth), then makes ONE pass over the
  vocabulary for the extra token (bonus / residual / ``p_{a+1}``; exponential race
  ``argmax(dist * (1 / noise))``; a greedy request's ``target_argmax`` at its first
  mismatch), and writes the request's output row.

The arithmetic is chosen to round exactly like the torch path: acceptance is a
product, not a quotient; ``1 / noise`` uses IEEE division (``div_rn``); the residual
is never normalised; argmax ties go to the first index. Only MTAD's ``log`` and its
running sum may differ in the last bit from torch (``torch.cumsum`` on CPU
accumulates in double), which matters only when ``S_i`` is within rounding of
``log(tau)``.

Kernels are decorated lazily (:func:`_kernels`), keyed by ``TRITON_INTERPRET``, so a
test can switch the interpreter on after this module was imported and so importing
this module never needs a GPU. Importing it does need Triton: the ``cuda`` backend
imports it only when ``verify`` is first called.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from vllm_specx.algorithms.verify import VerifyBatch, as_float32_uniforms
from vllm_specx.envflags import env_flag

__all__ = ["verify", "verify_with_num_accepted", "interpreter_enabled"]

# Kernel modes (constexpr): which rule the sampled (non-greedy) requests follow.
MODE_STANDARD = 0  # full draft probabilities q
MODE_ONE_HOT = 1  # one-hot drafter: q(x) = 1, residual = p without x
MODE_MTAD = 2  # joint-likelihood threshold

_MAX_BLOCK_V = 4096


def _token_accept(
    draft_ptr,  # [T] int
    tok_greedy_ptr,  # [T] int8: the token's request is greedy
    argmax_ptr,  # [T] int64: the target's greedy token
    target_ptr,  # [T, V] float32
    draft_probs_ptr,  # [T, V] float32 (MODE_STANDARD only)
    q_tok_ptr,  # [T] float32 (MODE_MTAD only)
    uniforms_ptr,  # [T] float32
    ok_ptr,  # [T] int8 out: accepted (greedy and standard)
    term_ptr,  # [T] float32 out: MTAD log-ratio (sampled requests)
    V,
    MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    x = tl.load(draft_ptr + t).to(tl.int64)
    id_ok = (x >= 0) & (x < V)
    xs = tl.where(id_ok, x, 0)
    greedy = tl.load(tok_greedy_ptr + t) != 0
    row = target_ptr + t * V
    if greedy:
        tl.store(ok_ptr + t, (x == tl.load(argmax_ptr + t)).to(tl.int8))
    else:
        p_x = tl.load(row + xs)
        if MODE == 2:
            q_x = tl.load(q_tok_ptr + t)
            good = id_ok & (p_x > 0) & (q_x > 0)
            term = tl.log(tl.where(good, p_x, 1.0)) - tl.log(tl.where(good, q_x, 1.0))
            tl.store(term_ptr + t, tl.where(good, term, float("-inf")))
        else:
            u = tl.load(uniforms_ptr + t)
            if MODE == 0:
                q_x = tl.load(draft_probs_ptr + t * V + xs)
                ok = id_ok & (q_x > 0) & (u * q_x < p_x)
            else:
                ok = id_ok & (u < p_x)
            tl.store(ok_ptr + t, ok.to(tl.int8))


def _finish(
    out_ptr,  # [B, K + 1] int64 out
    num_accepted_ptr,  # [B] int64 out
    cu_ptr,  # [B] int64
    draft_ptr,  # [T] int
    argmax_ptr,  # [T] int64: the target's greedy token
    ok_ptr,  # [T] int8
    term_ptr,  # [T] float32
    target_ptr,  # [T, V] float32
    draft_probs_ptr,  # [T, V] float32 (MODE_STANDARD only)
    bonus_ptr,  # [B, V] float32
    noise_ptr,  # [B, V] float32
    greedy_ptr,  # [B] int8
    V,
    K,
    log_tau,
    MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_ptr + b)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0)
    n = tl.minimum(tl.maximum(end - start, 0), K)
    greedy = tl.load(greedy_ptr + b) != 0
    sampled = tl.load(greedy_ptr + b) == 0

    # Accepted length: first rejection (greedy / standard), largest passing depth (MTAD).
    a_first = n
    failed = n < 0  # a False scalar of the right type
    a_joint = n * 0
    s = tl.zeros((), tl.float32)
    for i in range(0, n):
        ok = tl.load(ok_ptr + start + i) != 0
        a_first = tl.where(failed | ok, a_first, i)
        failed = failed | (ok == 0)
        if MODE == 2:
            # Sequential float32 sum: S_i = sum_{j<=i} log p_j(x_j) - log q_j(x_j).
            s += tl.load(term_ptr + start + i)
            a_joint = tl.where(s > log_tau, i + 1, a_joint)
    a = a_first
    if MODE == 2:
        a = tl.where(greedy, a_first, a_joint)

    # The one extra token, from the bonus row or from the row at position a.
    at_bonus = a >= n
    row = start + a
    if at_bonus:
        p_base = bonus_ptr + b * V
    else:
        p_base = target_ptr + row * V
    # Only sampled requests rejected under the standard rule draw from a residual.
    use_res = sampled & (a < n)
    x_r = tl.load(draft_ptr + row, mask=use_res, other=-1).to(tl.int64)
    best_p = tl.full((), float("-inf"), tl.float32)
    id_p = tl.full((), 0, tl.int64)
    best_r = tl.full((), float("-inf"), tl.float32)
    id_r = tl.full((), 0, tl.int64)
    res_max = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        p = tl.load(p_base + offs, mask=m, other=0.0)
        noise = tl.load(noise_ptr + b * V + offs, mask=tl.where(sampled, m, False), other=1.0)
        inv = tl.div_rn(
            tl.full((BLOCK_V,), 1.0, tl.float32), tl.maximum(noise, 1.1754943508222875e-38)
        )
        score = tl.where(greedy, p, p * inv)
        score = tl.where(m, score, float("-inf"))
        local, local_id = tl.max(score, axis=0, return_indices=True)
        better = local > best_p
        id_p = tl.where(better, (v0 + local_id).to(tl.int64), id_p)
        best_p = tl.where(better, local, best_p)
        if MODE != 2:
            if MODE == 0:
                q = tl.load(
                    draft_probs_ptr + row * V + offs, mask=tl.where(use_res, m, False), other=0.0
                )
                res = tl.maximum(p - q, 0.0)
            else:
                res = tl.where(offs == x_r, 0.0, p)
            res = tl.where(m, res, 0.0)
            res_max = tl.maximum(res_max, tl.max(res, axis=0))
            rscore = tl.where(m, res * inv, float("-inf"))
            local, local_id = tl.max(rscore, axis=0, return_indices=True)
            better = local > best_r
            id_r = tl.where(better, (v0 + local_id).to(tl.int64), id_r)
            best_r = tl.where(better, local, best_r)
    # A residual without mass (p == q) falls back to p, like the torch path.
    token = id_p
    if MODE != 2:
        token = tl.where(use_res & (res_max > 0), id_r, id_p)
    # A greedy request's token before the bonus is the batch's target_argmax (taken
    # from the logits, as vLLM does), not the argmax of the float32 probabilities.
    greedy_at_row = tl.load(argmax_ptr + row, mask=greedy & (a < n), other=0)
    token = tl.where(greedy & (a < n), greedy_at_row, token)

    cols = tl.arange(0, BLOCK_K)
    drafts = tl.load(draft_ptr + start + cols, mask=cols < a, other=-1).to(tl.int64)
    vals = tl.where(cols < a, drafts, tl.where(cols == a, token, -1))
    tl.store(out_ptr + b * (K + 1) + cols, vals, mask=cols < K + 1)
    tl.store(num_accepted_ptr + b, a.to(tl.int64))


_JIT_CACHE: dict[bool, tuple] = {}


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (kernels then run on CPU tensors)."""
    return env_flag("TRITON_INTERPRET")


def _kernels() -> tuple:
    """The two kernels, decorated for the current interpreter setting (cached)."""
    interpret = interpreter_enabled()
    kernels = _JIT_CACHE.get(interpret)
    if kernels is None:
        kernels = (triton.jit(_token_accept), triton.jit(_finish))
        _JIT_CACHE[interpret] = kernels
    return kernels


def verify_with_num_accepted(batch: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` plus the [B] int64 accepted counts the kernel already knows."""
    device = batch.bonus_probs.device
    if device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError(
            "the cuda backend's Triton verify needs CUDA tensors (or TRITON_INTERPRET=1 "
            "to run the kernels on CPU in tests)"
        )
    b, v = batch.num_requests, batch.vocab_size
    t = batch.num_tokens
    k = batch.max_spec_len
    out = torch.empty((b, k + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((b,), dtype=torch.int64, device=device)
    if b == 0:
        return out, num_accepted
    token_accept, finish = _kernels()

    draft_probs = batch.draft_probs
    if batch.rule == "mtad":
        mode = MODE_MTAD
        draft_probs = None  # q comes from draft_token_probs (VerifyBatch fills it in)
    else:
        mode = MODE_ONE_HOT if draft_probs is None else MODE_STANDARD

    drafts = batch.draft_token_ids.contiguous()
    assert batch.target_argmax is not None  # filled in by VerifyBatch
    target_argmax = batch.target_argmax.contiguous()
    target = batch.target_probs.to(torch.float32).contiguous()
    bonus = batch.bonus_probs.to(torch.float32).contiguous()
    noise = batch.exp_noise.to(torch.float32).contiguous()
    q_full = draft_probs.to(torch.float32).contiguous() if draft_probs is not None else target
    cu = batch.cu_num_draft_tokens.to(torch.int64).contiguous()
    greedy = batch.is_greedy.to(torch.int8).contiguous()
    ok = torch.zeros((t,), dtype=torch.int8, device=device)
    term = torch.zeros((t,), dtype=torch.float32, device=device)
    block_v = min(triton.next_power_of_2(max(v, 1)), _MAX_BLOCK_V)

    if t > 0:
        # Request of each token, for its greedy flag; searchsorted keeps this sync-free.
        token_pos = torch.arange(t, device=device, dtype=torch.int64)
        req = torch.searchsorted(cu, token_pos, right=True).clamp(max=b - 1)
        tok_greedy = greedy.index_select(0, req).contiguous()
        q_tok = (
            batch.draft_token_probs.to(torch.float32).contiguous()
            if batch.draft_token_probs is not None
            else term
        )
        token_accept[(t,)](
            drafts, tok_greedy, target_argmax, target, q_full, q_tok,
            as_float32_uniforms(batch.uniforms).contiguous(), ok, term, v,
            MODE=mode, BLOCK_V=block_v,
        )  # fmt: skip

    log_tau = math.log(batch.acceptance_threshold) if batch.rule == "mtad" else 0.0
    # An empty target_argmax (no drafts) still needs a valid pointer: pass ``cu``.
    argmax_arg = target_argmax if t > 0 else cu
    finish[(b,)](
        out, num_accepted, cu, drafts, argmax_arg, ok, term, target, q_full, bonus, noise,
        greedy, v, k, log_tau,
        MODE=mode, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(k + 1),
    )  # fmt: skip
    return out, num_accepted


def verify(batch: VerifyBatch) -> torch.Tensor:
    """Triton implementation of :func:`vllm_specx.algorithms.verify.verify` (same contract)."""
    return verify_with_num_accepted(batch)[0]
