"""Verification of speculative drafts: one sampler, two rules, pure PyTorch.

This module is the reference implementation of the extended rejection sampler and
the code path the ``cpu`` and ``npu`` backends run. It imports nothing from vLLM.

Layout (vLLM's ragged spec-decode layout)
-----------------------------------------
``B`` requests, ``T`` draft tokens in total, ``K = max_spec_len``. Request ``b`` owns
the drafts ``draft_token_ids[start_b : end_b]`` with ``end_b = cu_num_draft_tokens[b]``
(inclusive cumulative sum) and ``start_b = end_b - n_b``. Row ``t`` of
``target_probs`` is the target's warped distribution at draft ``t`` (the distribution
that draft ``t`` is checked against); ``bonus_probs[b]`` is the target's distribution
after request ``b``'s last draft. The output is ``[B, K + 1]`` int64: the accepted
drafts, then exactly one extra token, then ``-1``.

Rules (design.md section 2)
---------------------------
* greedy requests (``is_greedy``), under either rule: accept while
  ``x_i == argmax p_i`` (first maximum, as ``torch.argmax``); then emit ``argmax`` of
  ``p`` at the first mismatch, or of the bonus distribution after a full accept.
* ``"standard"`` with full draft probabilities ``q``: accept ``x_i`` iff
  ``u_i < min(1, p_i(x_i) / q_i(x_i))``, evaluated as ``u_i * q_i(x_i) < p_i(x_i)`` in
  float32 (equivalent for ``q > 0``, needs no division, so every backend rounds the
  same way). At the first rejection the extra token is sampled from
  ``norm(max(p_i - q_i, 0))``; after a full accept from the bonus distribution.
* ``"standard"`` with a one-hot drafter (``draft_probs is None``): accept iff
  ``u_i < p_i(x_i)``; the replacement is sampled from ``p_i`` with ``x_i`` removed.
* ``"mtad"``: ``S_i = sum_{j<=i} log p_j(x_j) - log q_j(x_j)``; depth ``i`` passes iff
  ``S_i > log(tau)``; accept the largest passing depth ``a`` (0 if none) and sample the
  extra token from ``p_{a+1}`` (bonus distribution when ``a = n``). No residual.

Edge cases, decided once for every backend
------------------------------------------
* A request with 0 drafts emits one token from its bonus distribution.
* ``q(x) = 0`` (also ``q_j = 0`` for MTAD): the draft could not have sampled ``x``, so
  it is not a legitimate proposal and is rejected (MTAD: its term is ``-inf``, so this
  depth and every deeper one fail). This also keeps ``p/q`` and ``log q`` from
  producing inf/NaN.
* ``p(x) = 0``: never accepted by a sampled rule (``u*q < 0`` is false; MTAD term
  ``-inf``).
* A draft id outside ``[0, V)`` (vLLM pads with -1 in places) is rejected by every rule.
* Residual all zero (``p == q`` at the rejected position, reachable only through
  float rounding or ``u`` at the edge): fall back to ``p``.
* The extra token for a sampled request is ``argmax(dist * (1 / max(noise, tiny)))``
  over its ``[V]`` row of Exp(1) noise: the exponential race, which samples from
  ``dist / sum(dist)`` without normalising (normalising changes rounding, not the
  argmax's distribution). The clamp keeps a zero noise sample from making ``0 * inf``.
  Greedy requests ignore the noise.

Everything is vectorised over the batch: no Python loop over tokens or requests, no
host synchronisation (no ``.item()``/``.tolist()``), and no data-dependent shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RULES",
    "RequestLayout",
    "request_layout",
    "valid_draft_ids",
    "greedy_accept",
    "rejection_accept",
    "joint_log_ratio",
    "first_rejection",
    "largest_passing_depth",
    "accepted_lengths",
    "extra_token_distribution",
    "sample_extra_token",
    "assemble_output",
    "num_accepted_from_output",
    "check_verify_args",
    "as_float32_uniforms",
    "verify",
]

PLACEHOLDER_TOKEN_ID = -1
RULES: tuple[str, ...] = ("standard", "mtad")

# Smallest normal float32: 1 / TINY is finite, so a zero noise sample cannot produce
# inf (and 0 * inf = NaN) in the exponential race.
_TINY = torch.finfo(torch.float32).tiny
# Largest float32 below 1. vLLM draws uniforms in float64; casting one in
# [1 - 2**-25, 1) to float32 rounds it up to 1.0, which would reject a draft with
# p(x) == q(x) (ratio 1, always accepted). Clamping keeps u < 1 after the cast.
_BELOW_ONE = 1.0 - 2.0**-24


def as_float32_uniforms(uniforms: torch.Tensor) -> torch.Tensor:
    """The acceptance uniforms as every backend uses them: float32, still below 1."""
    return uniforms.to(torch.float32).clamp(max=_BELOW_ONE)


@dataclass(frozen=True)
class RequestLayout:
    """The ragged layout, padded to ``[B, K]`` views (built once per call).

    ``start``/``num``: [B] int64 first flat draft index and draft count (clamped to K).
    ``valid``: [B, K] bool, position ``k < num``. ``token_index``: [B, K] int64 flat
    index of position ``k`` (clamped into ``[0, T)`` so gathers stay in bounds; only
    meaningful where ``valid``). ``positions``: [K] float32 ``0..K-1`` (exact below
    2**24; float so that every reduction over positions is a float32 min/max, the
    reductions every device has).
    """

    start: torch.Tensor
    num: torch.Tensor
    valid: torch.Tensor
    token_index: torch.Tensor
    positions: torch.Tensor
    num_tokens: int
    max_spec_len: int


def request_layout(
    cu_num_draft_tokens: torch.Tensor, num_tokens: int, max_spec_len: int
) -> RequestLayout:
    """Padded ``[B, K]`` indexing of vLLM's ragged layout (no host sync)."""
    cu = cu_num_draft_tokens.to(torch.int64)
    prev = torch.cat([cu.new_zeros(1), cu[:-1]])
    # Drafts beyond max_spec_len cannot be emitted (the output has K + 1 columns).
    num = (cu - prev).clamp(min=0, max=max_spec_len)
    steps = torch.arange(max_spec_len, device=cu.device, dtype=torch.int64)
    valid = steps[None, :] < num[:, None]
    token_index = prev[:, None] + steps[None, :]
    positions = steps.to(torch.float32)
    token_index = token_index.clamp(min=0, max=max(num_tokens - 1, 0))
    return RequestLayout(prev, num, valid, token_index, positions, num_tokens, max_spec_len)


def _pad(per_token: torch.Tensor, layout: RequestLayout, fill: float | bool) -> torch.Tensor:
    """[T] per-token values -> [B, K], ``fill`` where there is no draft."""
    if layout.num_tokens == 0:
        shape = (layout.valid.shape[0], layout.max_spec_len)
        return torch.full(shape, fill, dtype=per_token.dtype, device=per_token.device)
    # index_select + view rather than advanced indexing: one plain gather op on every
    # device (aten::index with a 2-D index is slow or missing on some). Booleans travel
    # as int32, which every device's gather takes.
    is_bool = per_token.dtype == torch.bool
    source = per_token.to(torch.int32) if is_bool else per_token
    padded = source.index_select(0, layout.token_index.reshape(-1)).view_as(layout.token_index)
    if is_bool:
        padded = padded != 0
    return torch.where(layout.valid, padded, torch.full_like(padded, fill))


def valid_draft_ids(
    draft_token_ids: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``ok``, ``safe``): which ids are in ``[0, V)``, and the ids clamped for gathers."""
    ids = draft_token_ids.to(torch.int64)
    ok = (ids >= 0) & (ids < vocab_size)
    return ok, torch.where(ok, ids, torch.zeros_like(ids))


def _prob_of_draft(probs: torch.Tensor, safe_ids: torch.Tensor) -> torch.Tensor:
    return probs.gather(1, safe_ids[:, None]).squeeze(1)


def greedy_accept(draft_token_ids: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """[T] bool: draft equals the target argmax (first maximum on ties)."""
    ok, _ = valid_draft_ids(draft_token_ids, target_probs.shape[-1])
    return ok & (draft_token_ids.to(torch.int64) == target_probs.argmax(dim=-1))


def rejection_accept(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T] bool: the standard per-token test, ``u * q(x) < p(x)`` (``q = 1`` if one-hot).

    Evaluated in float32 by every backend; ``q(x) = 0`` and invalid ids reject.
    """
    ok, safe = valid_draft_ids(draft_token_ids, target_probs.shape[-1])
    p_x = _prob_of_draft(target_probs, safe)
    u = as_float32_uniforms(uniforms)
    if draft_probs is None:
        return ok & (u < p_x)
    q_x = _prob_of_draft(draft_probs, safe)
    return ok & (q_x > 0) & (u * q_x < p_x)


def joint_log_ratio(
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    draft_token_probs: torch.Tensor,
) -> torch.Tensor:
    """[T] float32 MTAD terms ``log p(x) - log q(x)``; ``-inf`` where p, q or the id is 0/invalid.

    Never ``+inf`` or NaN: a zero ``q`` is a failure, not an infinite reward.
    """
    ok, safe = valid_draft_ids(draft_token_ids, target_probs.shape[-1])
    p_x = _prob_of_draft(target_probs, safe)
    q_x = draft_token_probs.to(torch.float32)
    good = ok & (p_x > 0) & (q_x > 0)
    one = torch.ones_like(p_x)
    # log of 1 where not good, so no -inf - -inf = NaN is ever formed.
    term = torch.log(torch.where(good, p_x, one)) - torch.log(torch.where(good, q_x, one))
    return torch.where(good, term, torch.full_like(term, -math.inf))


def first_rejection(accepted: torch.Tensor, layout: RequestLayout) -> torch.Tensor:
    """[B] int64 number of leading accepted drafts (index of the first rejection).

    ``accepted``: [B, K] bool. A float32 min over the failing positions (K if none)
    instead of a boolean cumprod: a reduction every device has.
    """
    k = layout.max_spec_len
    if k == 0:
        return torch.zeros_like(layout.num)
    fail = ~accepted | ~layout.valid
    pos = torch.where(fail, layout.positions[None, :], torch.full_like(layout.positions, k))
    return pos.amin(dim=1).to(torch.int64)


def largest_passing_depth(
    log_ratio: torch.Tensor, layout: RequestLayout, acceptance_threshold: float
) -> torch.Tensor:
    """[B] int64 MTAD accepted length: the largest ``i`` with ``S_i > log(tau)`` (0 if none).

    ``log_ratio``: [T] terms from :func:`joint_log_ratio`.
    """
    k = layout.max_spec_len
    if k == 0:
        return torch.zeros_like(layout.num)
    terms = _pad(log_ratio.to(torch.float32), layout, 0.0)
    cumulative = torch.cumsum(terms, dim=1)
    passes = (cumulative > math.log(acceptance_threshold)) & layout.valid
    # Largest passing depth as a float32 max over (position + 1), 0 where none passes.
    depth = torch.where(passes, layout.positions + 1, torch.zeros_like(layout.positions))
    return depth.amax(dim=1).to(torch.int64)


def accepted_lengths(
    rule: str,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None = None,
    draft_token_probs: torch.Tensor | None = None,
    acceptance_threshold: float = 1.0,
    layout: RequestLayout | None = None,
) -> torch.Tensor:
    """[B] int64 number of accepted drafts per request (the acceptance half of :func:`verify`)."""
    if layout is None:
        layout = request_layout(cu_num_draft_tokens, draft_token_ids.shape[0], max_spec_len)
    greedy = is_greedy.to(torch.bool)
    if layout.num_tokens == 0:
        return torch.zeros_like(layout.num)
    greedy_ok = _pad(greedy_accept(draft_token_ids, target_probs), layout, False)
    n_greedy = first_rejection(greedy_ok, layout)
    if rule == "mtad":
        q_tok = draft_token_probs
        if q_tok is None:
            assert draft_probs is not None
            _, safe = valid_draft_ids(draft_token_ids, target_probs.shape[-1])
            q_tok = _prob_of_draft(draft_probs, safe)
        terms = joint_log_ratio(draft_token_ids, target_probs, q_tok)
        n_sampled = largest_passing_depth(terms, layout, acceptance_threshold)
    else:
        ok = rejection_accept(draft_token_ids, target_probs, uniforms, draft_probs)
        n_sampled = first_rejection(_pad(ok, layout, False), layout)
    return torch.where(greedy, n_greedy, n_sampled)


def extra_token_distribution(
    rule: str,
    num_accepted: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    bonus_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    layout: RequestLayout,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, V] unnormalised distribution of each request's one extra token.

    Bonus distribution after a full accept; otherwise ``p`` at the first unaccepted
    position, replaced by the residual for sampled requests under ``"standard"``
    (``max(p - q, 0)``, or ``p`` without ``x`` for a one-hot drafter), with ``p`` as
    the fallback when the residual has no mass.
    """
    at_bonus = num_accepted >= layout.num
    if layout.num_tokens == 0:
        return bonus_probs.to(torch.float32)
    row = (layout.start + num_accepted).clamp(max=layout.num_tokens - 1)
    p_row = target_probs.index_select(0, row).to(torch.float32)
    dist = torch.where(at_bonus[:, None], bonus_probs.to(torch.float32), p_row)
    if rule != "standard":
        return dist
    if draft_probs is not None:
        q_row = draft_probs.index_select(0, row).to(torch.float32)
        residual = (p_row - q_row).clamp(min=0)
    else:
        # Remove the rejected draft itself. An invalid id (-1) matches no column,
        # so its "residual" is p, which is what a non-proposal deserves.
        x_row = draft_token_ids.to(torch.int64).index_select(0, row)
        vocab = torch.arange(p_row.shape[-1], device=p_row.device, dtype=torch.int64)
        residual = torch.where(vocab[None, :] == x_row[:, None], torch.zeros_like(p_row), p_row)
    has_mass = residual.amax(dim=-1) > 0
    use_residual = ~is_greedy.to(torch.bool) & ~at_bonus & has_mass
    return torch.where(use_residual[:, None], residual, dist)


def sample_extra_token(
    dist: torch.Tensor, exp_noise: torch.Tensor, is_greedy: torch.Tensor
) -> torch.Tensor:
    """[B] int64: ``argmax(dist)`` for greedy rows, ``argmax(dist / noise)`` otherwise.

    ``dist / noise`` is evaluated as ``dist * (1 / max(noise, tiny))`` in float32, the
    same rounding as the Triton kernel. Ties go to the first index (``torch.argmax``).
    """
    inv_noise = exp_noise.to(torch.float32).clamp(min=_TINY).reciprocal()
    score = torch.where(is_greedy.to(torch.bool)[:, None], dist, dist * inv_noise)
    return score.argmax(dim=-1)


def assemble_output(
    draft_token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    extra_token: torch.Tensor,
    layout: RequestLayout,
) -> torch.Tensor:
    """[B, K + 1] int64: accepted drafts, the extra token, then -1."""
    b, k = layout.valid.shape[0], layout.max_spec_len
    drafts = _pad(draft_token_ids.to(torch.int64), layout, PLACEHOLDER_TOKEN_ID)
    drafts = torch.cat([drafts, drafts.new_full((b, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    cols = torch.arange(k + 1, device=drafts.device, dtype=torch.int64)[None, :]
    n = num_accepted[:, None]
    placeholder = torch.full_like(drafts, PLACEHOLDER_TOKEN_ID)
    extra = extra_token.to(torch.int64)[:, None].expand(b, k + 1)
    return torch.where(cols < n, drafts, torch.where(cols == n, extra, placeholder))


def num_accepted_from_output(output_token_ids: torch.Tensor) -> torch.Tensor:
    """[B] int64 accepted drafts per request, read off a ``verify`` output (no host sync)."""
    return (output_token_ids != PLACEHOLDER_TOKEN_ID).sum(dim=-1) - 1


def check_verify_args(
    rule: str,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    bonus_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    exp_noise: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    draft_token_probs: torch.Tensor | None,
    acceptance_threshold: float,
) -> None:
    """Shape and argument checks shared by every backend (host metadata only, no sync)."""
    if rule not in RULES:
        raise ValueError(f"verify rule {rule!r} is not one of {', '.join(RULES)}")
    t = draft_token_ids.shape[0]
    b, v = bonus_probs.shape
    if draft_token_ids.ndim != 1:
        raise ValueError(f"draft_token_ids must be [T], got {tuple(draft_token_ids.shape)}")
    if tuple(cu_num_draft_tokens.shape) != (b,):
        raise ValueError(
            f"cu_num_draft_tokens must be [B={b}], got {tuple(cu_num_draft_tokens.shape)}"
        )
    if tuple(target_probs.shape) != (t, v):
        raise ValueError(f"target_probs must be [T={t}, V={v}], got {tuple(target_probs.shape)}")
    if tuple(is_greedy.shape) != (b,):
        raise ValueError(f"is_greedy must be [B={b}], got {tuple(is_greedy.shape)}")
    if tuple(uniforms.shape) != (t,):
        raise ValueError(f"uniforms must be [T={t}], got {tuple(uniforms.shape)}")
    if tuple(exp_noise.shape) != (b, v):
        raise ValueError(f"exp_noise must be [B={b}, V={v}], got {tuple(exp_noise.shape)}")
    if max_spec_len < 0:
        raise ValueError(f"max_spec_len must be >= 0, got {max_spec_len}")
    if draft_probs is not None and tuple(draft_probs.shape) != (t, v):
        raise ValueError(f"draft_probs must be [T={t}, V={v}], got {tuple(draft_probs.shape)}")
    if rule == "standard" and draft_token_probs is not None:
        raise ValueError(
            "draft_token_probs is only used by rule='mtad'; the standard rule needs the full "
            "draft_probs [T, V] (or None for a one-hot drafter)"
        )
    if rule == "mtad":
        if draft_token_probs is None and draft_probs is None:
            raise ValueError("rule='mtad' needs draft_token_probs [T] (or draft_probs [T, V])")
        if draft_token_probs is not None and tuple(draft_token_probs.shape) != (t,):
            raise ValueError(
                f"draft_token_probs must be [T={t}], got {tuple(draft_token_probs.shape)}"
            )
        if not 0.0 < acceptance_threshold <= 1.0:
            raise ValueError(
                f"acceptance_threshold must be in (0, 1], got {acceptance_threshold!r}"
            )


def verify(
    rule: str,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    bonus_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    exp_noise: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None = None,
    draft_token_probs: torch.Tensor | None = None,
    acceptance_threshold: float = 1.0,
) -> torch.Tensor:
    """Verify a ragged batch of drafts; return ``[B, max_spec_len + 1]`` int64 tokens.

    Args:
        rule: ``"standard"`` (lossless rejection sampling) or ``"mtad"`` (joint
            likelihood threshold). Greedy requests use the greedy rule under both.
        draft_token_ids: [T] int flattened drafts.
        cu_num_draft_tokens: [B] int inclusive cumsum of per-request draft counts.
        target_probs: [T, V] float32 warped target probabilities at each draft.
        bonus_probs: [B, V] warped target probabilities after each request's last draft.
        is_greedy: [B] bool; for greedy rows only the argmax of the probs matters.
        uniforms: [T] float in [0, 1) acceptance randomness (used as float32).
        exp_noise: [B, V] Exp(1) noise; the single extra token per request is
            ``argmax(dist / noise)``.
        max_spec_len: K, the output has K + 1 columns.
        draft_probs: standard: [T, V] full draft probabilities, or None for a one-hot
            drafter. mtad: optional source of ``q_j(x_j)`` if ``draft_token_probs`` is None.
        draft_token_probs: mtad: [T] draft probability of each drafted token.
        acceptance_threshold: mtad ``tau`` in (0, 1].

    Returns:
        [B, K + 1] int64: accepted drafts, one extra token, then -1 (PLACEHOLDER).
    """
    check_verify_args(
        rule,
        draft_token_ids,
        cu_num_draft_tokens,
        target_probs,
        bonus_probs,
        is_greedy,
        uniforms,
        exp_noise,
        max_spec_len,
        draft_probs,
        draft_token_probs,
        acceptance_threshold,
    )
    if bonus_probs.shape[0] == 0:
        return torch.empty((0, max_spec_len + 1), dtype=torch.int64, device=bonus_probs.device)
    target_probs = target_probs.to(torch.float32)
    is_greedy = is_greedy.to(torch.bool)
    layout = request_layout(cu_num_draft_tokens, draft_token_ids.shape[0], max_spec_len)
    num_accepted = accepted_lengths(
        rule,
        draft_token_ids,
        cu_num_draft_tokens,
        target_probs,
        is_greedy,
        uniforms,
        max_spec_len,
        draft_probs=draft_probs,
        draft_token_probs=draft_token_probs,
        acceptance_threshold=acceptance_threshold,
        layout=layout,
    )
    dist = extra_token_distribution(
        rule,
        num_accepted,
        draft_token_ids,
        target_probs,
        bonus_probs,
        is_greedy,
        layout,
        draft_probs=draft_probs if rule == "standard" else None,
    )
    extra = sample_extra_token(dist, exp_noise, is_greedy)
    return assemble_output(draft_token_ids, num_accepted, extra, layout)
