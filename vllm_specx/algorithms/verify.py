"""Verification of speculative drafts: one sampler, two rules, pure PyTorch.

This module is the reference implementation of the extended rejection sampler and
the code path the ``cpu`` and ``npu`` backends run. It imports nothing from vLLM.

The batch: :class:`VerifyBatch`
-------------------------------
Every backend takes ONE frozen :class:`VerifyBatch`, validated once on construction,
in vLLM's ragged spec-decode layout: ``B`` requests, ``T`` draft tokens in total,
``K = max_spec_len``. Request ``b`` owns the drafts ``draft_token_ids[start_b : end_b]``
with ``end_b = cu_num_draft_tokens[b]`` (inclusive cumulative sum) and
``start_b = end_b - n_b``. Row ``t`` of ``target_probs`` is the target's warped
distribution at draft ``t`` (the distribution that draft ``t`` is checked against);
``target_argmax[t]`` is the target's greedy token there; ``bonus_probs[b]`` is the
target's distribution after request ``b``'s last draft. The output is ``[B, K + 1]``
int64: the accepted drafts, then exactly one extra token, then ``-1``.

Rules (speculative sampling, Leviathan et al. 2023; MTAD, Qin et al. 2024)
--------------------------------------------------------------------------
* greedy requests (``is_greedy``), under either rule: accept while
  ``x_i == target_argmax_i``; then emit ``target_argmax`` at the first mismatch, or
  ``argmax`` (first maximum) of the bonus distribution after a full accept.
  ``target_argmax`` is taken from the same logits vLLM's sampler takes its argmax of
  (the sampler glue passes it), NOT from the float32 probabilities: two logits closer
  than float32 softmax resolution become equal probabilities, and the argmax of the
  probabilities would then pick the lower index where vLLM picks the other, so greedy
  decoding with speculation could differ from greedy decoding without it. When the
  caller has no logits (tests, benchmarks) it defaults to ``target_probs.argmax``.
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
from dataclasses import dataclass, replace

import torch

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RULES",
    "VerifyBatch",
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
    "greedy_extra_token",
    "sample_extra_token",
    "assemble_output",
    "num_accepted_from_output",
    "as_float32_uniforms",
    "verify",
    "verify_greedy",
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


def _shape_error(name: str, expected: str, got: torch.Tensor) -> ValueError:
    return ValueError(f"{name} must be {expected}, got {tuple(got.shape)}")


@dataclass(frozen=True)
class VerifyBatch:
    """One ragged verification batch: what every backend's ``verify`` takes.

    Validated once, on construction (host metadata only, no device sync); a bad field
    raises ``ValueError`` naming it, its shape and the expected one. Defaults are filled
    in then too, so a backend reads every field as set: ``target_argmax`` (the first
    maximum of ``target_probs`` when not given) and, for ``"mtad"``, ``draft_token_probs``
    (gathered from ``draft_probs`` when not given). Build a variant with
    :func:`dataclasses.replace`, which validates again.

    Fields (``B`` requests, ``T`` drafts, ``V`` vocabulary, ``K = max_spec_len``):
        rule: ``"standard"`` (lossless rejection sampling) or ``"mtad"`` (joint
            likelihood threshold). Greedy requests use the greedy rule under both.
        draft_token_ids: [T] int flattened drafts.
        cu_num_draft_tokens: [B] int inclusive cumsum of per-request draft counts.
        target_probs: [T, V] float32 warped target probabilities at each draft.
        bonus_probs: [B, V] warped target probabilities after each request's last draft.
        is_greedy: [B] bool.
        uniforms: [T] float in [0, 1) acceptance randomness (used as float32).
        exp_noise: [B, V] Exp(1) noise; a sampled request's one extra token is
            ``argmax(dist / noise)``.
        max_spec_len: K, the output has K + 1 columns.
        target_argmax: [T] int greedy target token at each draft, as vLLM's sampler
            takes it (argmax of the processed logits). Default ``target_probs.argmax``.
        draft_probs: standard: [T, V] full draft probabilities, or None for a one-hot
            drafter. mtad: optional source of ``q_j(x_j)`` if ``draft_token_probs`` is None.
        draft_token_probs: mtad only: [T] draft probability of each drafted token.
        acceptance_threshold: mtad ``tau`` in (0, 1].
    """

    rule: str
    draft_token_ids: torch.Tensor
    cu_num_draft_tokens: torch.Tensor
    target_probs: torch.Tensor
    bonus_probs: torch.Tensor
    is_greedy: torch.Tensor
    uniforms: torch.Tensor
    exp_noise: torch.Tensor
    max_spec_len: int
    target_argmax: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    draft_token_probs: torch.Tensor | None = None
    acceptance_threshold: float = 1.0

    def __post_init__(self) -> None:
        self._validate()
        # Frozen: defaults are filled in through object.__setattr__, once, here.
        if self.target_argmax is None:
            object.__setattr__(self, "target_argmax", self.target_probs.argmax(dim=-1))
        else:
            object.__setattr__(self, "target_argmax", self.target_argmax.to(torch.int64))
        if self.rule == "mtad" and self.draft_token_probs is None:
            assert self.draft_probs is not None  # _validate guarantees one of them
            _, safe = valid_draft_ids(self.draft_token_ids, self.vocab_size)
            object.__setattr__(self, "draft_token_probs", _prob_of_draft(self.draft_probs, safe))

    @property
    def num_requests(self) -> int:
        return self.bonus_probs.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.draft_token_ids.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.bonus_probs.shape[1]

    def with_float32_randomness(self) -> VerifyBatch:
        """The same batch with uniforms, noise and MTAD's ``q`` cast to float32 (vLLM
        draws the randomness in float64), for devices that should run no float64."""
        q_tok = self.draft_token_probs
        return replace(
            self,
            uniforms=as_float32_uniforms(self.uniforms),
            exp_noise=self.exp_noise.to(torch.float32),
            draft_token_probs=None if q_tok is None else q_tok.to(torch.float32),
        )

    def _validate(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"verify rule {self.rule!r} is not one of {', '.join(RULES)}")
        if self.bonus_probs.ndim != 2:
            raise _shape_error("bonus_probs", "[B, V]", self.bonus_probs)
        if self.draft_token_ids.ndim != 1:
            raise _shape_error("draft_token_ids", "[T]", self.draft_token_ids)
        b, v = self.bonus_probs.shape
        t = self.draft_token_ids.shape[0]
        expected: list[tuple[str, torch.Tensor | None, tuple[int, ...], str]] = [
            ("cu_num_draft_tokens", self.cu_num_draft_tokens, (b,), f"[B={b}]"),
            ("target_probs", self.target_probs, (t, v), f"[T={t}, V={v}]"),
            ("is_greedy", self.is_greedy, (b,), f"[B={b}]"),
            ("uniforms", self.uniforms, (t,), f"[T={t}]"),
            ("exp_noise", self.exp_noise, (b, v), f"[B={b}, V={v}]"),
            ("target_argmax", self.target_argmax, (t,), f"[T={t}]"),
            ("draft_probs", self.draft_probs, (t, v), f"[T={t}, V={v}]"),
            ("draft_token_probs", self.draft_token_probs, (t,), f"[T={t}]"),
        ]
        for name, tensor, shape, text in expected:
            if tensor is not None and tuple(tensor.shape) != shape:
                raise _shape_error(name, text, tensor)
        if self.max_spec_len < 0:
            raise ValueError(f"max_spec_len must be >= 0, got {self.max_spec_len}")
        if self.rule == "standard" and self.draft_token_probs is not None:
            raise ValueError(
                "draft_token_probs is only used by rule='mtad'; the standard rule needs the "
                "full draft_probs [T, V] (or None for a one-hot drafter)"
            )
        if self.rule == "mtad":
            if self.draft_token_probs is None and self.draft_probs is None:
                raise ValueError("rule='mtad' needs draft_token_probs [T] (or draft_probs [T, V])")
            if not 0.0 < self.acceptance_threshold <= 1.0:
                raise ValueError(
                    f"acceptance_threshold must be in (0, 1], got {self.acceptance_threshold!r}"
                )


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


def greedy_accept(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """[T] bool: the draft is the target's greedy token (-1 padding never is)."""
    return draft_token_ids.to(torch.int64) == target_argmax.to(torch.int64)


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


def accepted_lengths(batch: VerifyBatch, layout: RequestLayout | None = None) -> torch.Tensor:
    """[B] int64 number of accepted drafts per request (the acceptance half of :func:`verify`)."""
    if layout is None:
        layout = request_layout(batch.cu_num_draft_tokens, batch.num_tokens, batch.max_spec_len)
    if layout.num_tokens == 0:
        return torch.zeros_like(layout.num)
    assert batch.target_argmax is not None  # filled in by VerifyBatch
    target_probs = batch.target_probs.to(torch.float32)
    greedy_ok = _pad(greedy_accept(batch.draft_token_ids, batch.target_argmax), layout, False)
    n_greedy = first_rejection(greedy_ok, layout)
    if batch.rule == "mtad":
        assert batch.draft_token_probs is not None  # filled in by VerifyBatch
        terms = joint_log_ratio(batch.draft_token_ids, target_probs, batch.draft_token_probs)
        n_sampled = largest_passing_depth(terms, layout, batch.acceptance_threshold)
    else:
        ok = rejection_accept(
            batch.draft_token_ids, target_probs, batch.uniforms, batch.draft_probs
        )
        n_sampled = first_rejection(_pad(ok, layout, False), layout)
    return torch.where(batch.is_greedy.to(torch.bool), n_greedy, n_sampled)


def _extra_token_row(num_accepted: torch.Tensor, layout: RequestLayout) -> torch.Tensor:
    """[B] int64 flat index of the first unaccepted draft (clamped in bounds)."""
    return (layout.start + num_accepted).clamp(max=max(layout.num_tokens - 1, 0))


def extra_token_distribution(
    batch: VerifyBatch, num_accepted: torch.Tensor, layout: RequestLayout
) -> torch.Tensor:
    """[B, V] unnormalised distribution of each sampled request's one extra token.

    Bonus distribution after a full accept; otherwise ``p`` at the first unaccepted
    position, replaced by the residual for sampled requests under ``"standard"``
    (``max(p - q, 0)``, or ``p`` without ``x`` for a one-hot drafter), with ``p`` as
    the fallback when the residual has no mass.
    """
    bonus_probs = batch.bonus_probs.to(torch.float32)
    if layout.num_tokens == 0:
        return bonus_probs
    at_bonus = num_accepted >= layout.num
    row = _extra_token_row(num_accepted, layout)
    p_row = batch.target_probs.index_select(0, row).to(torch.float32)
    dist = torch.where(at_bonus[:, None], bonus_probs, p_row)
    if batch.rule != "standard":
        return dist
    if batch.draft_probs is not None:
        q_row = batch.draft_probs.index_select(0, row).to(torch.float32)
        residual = (p_row - q_row).clamp(min=0)
    else:
        # Remove the rejected draft itself. An invalid id (-1) matches no column,
        # so its "residual" is p, which is what a non-proposal deserves.
        x_row = batch.draft_token_ids.to(torch.int64).index_select(0, row)
        vocab = torch.arange(p_row.shape[-1], device=p_row.device, dtype=torch.int64)
        residual = torch.where(vocab[None, :] == x_row[:, None], torch.zeros_like(p_row), p_row)
    has_mass = residual.amax(dim=-1) > 0
    use_residual = ~batch.is_greedy.to(torch.bool) & ~at_bonus & has_mass
    return torch.where(use_residual[:, None], residual, dist)


def greedy_extra_token(
    batch: VerifyBatch, num_accepted: torch.Tensor, layout: RequestLayout
) -> torch.Tensor:
    """[B] int64 a greedy request's extra token: ``target_argmax`` at the first mismatch,
    the bonus distribution's first maximum after a full accept."""
    bonus_token = batch.bonus_probs.to(torch.float32).argmax(dim=-1)
    if layout.num_tokens == 0:
        return bonus_token
    assert batch.target_argmax is not None  # filled in by VerifyBatch
    at_row = batch.target_argmax.index_select(0, _extra_token_row(num_accepted, layout))
    return torch.where(num_accepted >= layout.num, bonus_token, at_row)


def sample_extra_token(
    dist: torch.Tensor,
    exp_noise: torch.Tensor,
    is_greedy: torch.Tensor,
    greedy_token: torch.Tensor,
) -> torch.Tensor:
    """[B] int64: ``greedy_token`` for greedy rows, ``argmax(dist / noise)`` otherwise.

    ``dist / noise`` is evaluated as ``dist * (1 / max(noise, tiny))`` in float32, the
    same rounding as the Triton kernel. Ties go to the first index (``torch.argmax``).
    """
    inv_noise = exp_noise.to(torch.float32).clamp(min=_TINY).reciprocal()
    sampled = (dist * inv_noise).argmax(dim=-1)
    return torch.where(is_greedy.to(torch.bool), greedy_token.to(torch.int64), sampled)


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


def verify(batch: VerifyBatch) -> torch.Tensor:
    """Verify a ragged batch of drafts; return ``[B, max_spec_len + 1]`` int64 tokens:
    accepted drafts, one extra token, then -1 (PLACEHOLDER). Rules: module docstring."""
    k = batch.max_spec_len
    if batch.num_requests == 0:
        return torch.empty((0, k + 1), dtype=torch.int64, device=batch.bonus_probs.device)
    layout = request_layout(batch.cu_num_draft_tokens, batch.num_tokens, k)
    num_accepted = accepted_lengths(batch, layout)
    dist = extra_token_distribution(batch, num_accepted, layout)
    greedy_token = greedy_extra_token(batch, num_accepted, layout)
    extra = sample_extra_token(dist, batch.exp_noise, batch.is_greedy, greedy_token)
    return assemble_output(batch.draft_token_ids, num_accepted, extra, layout)


def verify_greedy(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    target_argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    max_spec_len: int,
    uniform: bool = False,
) -> torch.Tensor:
    """:func:`verify` for a batch whose requests are ALL greedy, from token ids alone.

    Greedy verification reads nothing but the target's greedy token per draft
    (``target_argmax``, ``[T]``) and after the last one (``bonus_token_ids``, ``[B]``):
    accept while ``x_i == target_argmax_i``, then emit ``target_argmax`` at the first
    mismatch or the bonus token after a full accept. So an all-greedy step needs no
    ``[T, V]`` probabilities, no ``[B, V]`` bonus rows and no random draws (vLLM's own
    sampler takes the same shortcut); the output equals :func:`verify` on the same step
    with ``is_greedy`` all True and ``bonus_probs`` one-hot at ``bonus_token_ids``, under
    either rule. ``[B, max_spec_len + 1]`` int64, no host sync.

    ``uniform=True`` (the caller knows on the host that every request has exactly
    ``max_spec_len`` drafts, a fixed-K step): the same output from a ``[B, K]`` view of
    the drafts, with no ragged layout to build: a fraction of the ops, which is what an
    all-greedy step costs on a GPU, where each op is a kernel launch.
    """
    if uniform and max_spec_len > 0:
        return _verify_greedy_uniform(draft_token_ids, target_argmax, bonus_token_ids,
                                      max_spec_len)
    bonus = bonus_token_ids.reshape(-1).to(torch.int64)
    num_tokens = int(draft_token_ids.shape[0])
    layout = request_layout(cu_num_draft_tokens, num_tokens, max_spec_len)
    if num_tokens == 0:
        num_accepted = torch.zeros_like(layout.num)
        extra = bonus
    else:
        accepted = _pad(greedy_accept(draft_token_ids, target_argmax), layout, False)
        num_accepted = first_rejection(accepted, layout)
        at_row = target_argmax.to(torch.int64).index_select(
            0, _extra_token_row(num_accepted, layout))
        extra = torch.where(num_accepted >= layout.num, bonus, at_row)
    return assemble_output(draft_token_ids, num_accepted, extra, layout)


def _verify_greedy_uniform(draft_token_ids: torch.Tensor, target_argmax: torch.Tensor,
                           bonus_token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`verify_greedy` when every request has exactly ``k`` drafts (``T = B k``).

    Row ``r`` of ``[target_argmax | bonus]`` (``[B, K + 1]``) is the output itself up to
    the first mismatch ``n``: before it the drafts equal the target's greedy tokens, at
    it stands the target's token (or the bonus after a full accept), then -1."""
    b = bonus_token_ids.numel()
    target = target_argmax.to(torch.int64).view(b, k)
    match = draft_token_ids.to(torch.int64).view(b, k) == target
    # The first mismatch (k if none) as a float min, as first_rejection takes it (no
    # boolean cumprod: a reduction every device has).
    steps = torch.arange(k + 1, device=target.device, dtype=torch.float32)
    num_accepted = torch.where(match, float(k), steps[:k]).amin(dim=1, keepdim=True)
    out = torch.cat([target, bonus_token_ids.reshape(b, 1).to(torch.int64)], dim=1)
    return out.masked_fill(steps[None, :] > num_accepted, PLACEHOLDER_TOKEN_ID)
