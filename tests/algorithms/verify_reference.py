"""Slow, obviously-correct reference for the verification rules, plus random batches.

The reference walks ONE request at a time with plain Python loops over float64
numbers (the rules of ``vllm_specx.algorithms.verify``, read literally) on the same
``VerifyBatch`` the backends take. It also reports whether a request's outcome is
*fragile*: decided by a comparison closer than float32 rounding
(``u`` within 1e-6 of ``p/q``, ``S_i`` within ~1e-4 of ``log tau``, or two extra-token
scores within 1e-5 relative). The float32 implementations may legitimately decide
those the other way, so exact-match tests skip them and assert they are rare.

Not a test module (no ``test_`` prefix); imported by tests in ``tests/algorithms``
and ``tests/backends`` (whose conftest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_specx.algorithms.verify import VerifyBatch

RULE_VARIANTS = ("standard", "one_hot", "mtad")


# ----------------------------------------------------------------------------- reference


def first_argmax(values: np.ndarray) -> int:
    """Index of the first maximum, written out (the tie-break torch.argmax documents)."""
    best = 0
    for i in range(1, len(values)):
        if values[i] > values[best]:
            best = i
    return best


def race(dist: np.ndarray, noise: np.ndarray) -> tuple[int, bool]:
    """Exponential race: ``argmax dist / noise`` (samples from dist / sum(dist)).

    Returns the winner and whether the runner-up is within float32 rounding.
    """
    scores = [float(d) / max(float(e), 1.1754943508222875e-38) for d, e in zip(dist, noise)]
    winner = first_argmax(np.asarray(scores))
    best = scores[winner]
    others = [s for i, s in enumerate(scores) if i != winner]
    fragile = best > 0 and bool(others) and max(others) >= best * (1 - 1e-5)
    return winner, fragile


def reference_verify(batch: VerifyBatch) -> tuple[list[list[int]], list[bool]]:
    """Per-request loop: (emitted tokens per request, fragile flag per request)."""
    cu = batch.cu_num_draft_tokens.tolist()
    drafts = batch.draft_token_ids.tolist()
    target = batch.target_probs.double().numpy()
    bonus = batch.bonus_probs.double().numpy()
    draft_probs = None if batch.draft_probs is None else batch.draft_probs.double().numpy()
    q_tok = None if batch.draft_token_probs is None else batch.draft_token_probs.tolist()
    greedy = batch.is_greedy.tolist()
    target_argmax = batch.target_argmax.tolist()
    uniforms = batch.uniforms.double().tolist()
    noise = batch.exp_noise.double().numpy()
    vocab = bonus.shape[1]
    log_tau = math.log(batch.acceptance_threshold)
    outputs: list[list[int]] = []
    fragile_flags: list[bool] = []
    for b in range(len(cu)):
        start = cu[b - 1] if b > 0 else 0
        n = min(cu[b] - start, batch.max_spec_len)
        xs = drafts[start : start + n]
        rows = [target[start + i] for i in range(n)]
        fragile = False

        def ok_id(x: int) -> bool:
            return 0 <= x < vocab

        if greedy[b]:
            # The batch's greedy token (vLLM's argmax of the logits), not the probs'.
            a = 0
            while a < n and ok_id(xs[a]) and xs[a] == target_argmax[start + a]:
                a += 1
            token = target_argmax[start + a] if a < n else first_argmax(bonus[b])
        elif batch.rule == "standard":
            a = n
            dist = bonus[b]
            for i in range(n):
                x = xs[i]
                if not ok_id(x):
                    accept = False
                else:
                    p = rows[i][x]
                    q = 1.0 if draft_probs is None else draft_probs[start + i][x]
                    u = uniforms[start + i]
                    if q <= 0:
                        accept = False  # the draft could not have proposed x
                    else:
                        accept = u < min(1.0, p / q)
                        fragile |= abs(u * q - p) <= 1e-6 * max(p, u * q)
                if not accept:
                    a = i
                    p_row = rows[i]
                    if draft_probs is None:
                        residual = np.array(p_row)
                        if ok_id(x):
                            residual[x] = 0.0
                    else:
                        residual = np.maximum(p_row - draft_probs[start + i], 0.0)
                    dist = residual if residual.sum() > 0 else p_row
                    break
            token, race_fragile = race(dist, noise[b])
            fragile |= race_fragile
        else:  # mtad
            a = 0
            s = 0.0
            magnitude = 0.0
            all_zero = True  # every term exactly 0 (p == q): the sum is exact everywhere
            for i in range(n):
                x = xs[i]
                p = rows[i][x] if ok_id(x) else 0.0
                q = q_tok[start + i] if q_tok is not None else draft_probs[start + i][x]
                if p > 0 and q > 0:
                    term = math.log(p) - math.log(q)
                else:
                    term = -math.inf
                s += term
                magnitude += abs(term) if math.isfinite(term) else 0.0
                all_zero &= term == 0.0
                if s > log_tau:
                    a = i + 1  # the LARGEST passing depth: keep looking
                if math.isfinite(s) and not all_zero:
                    fragile |= abs(s - log_tau) <= 1e-4 * (1.0 + magnitude)
            dist = rows[a] if a < n else bonus[b]
            token, race_fragile = race(dist, noise[b])
            fragile |= race_fragile
        outputs.append(list(xs[:a]) + [token])
        fragile_flags.append(fragile)
    return outputs, fragile_flags


def output_rows(out: torch.Tensor) -> list[list[int]]:
    """[B, K + 1] verify output -> emitted tokens per request (asserting the -1 padding)."""
    rows = []
    for row in out.tolist():
        emitted = [t for t in row if t != -1]
        assert row[: len(emitted)] == emitted, f"-1 inside the emitted prefix: {row}"
        rows.append(emitted)
    return rows


# ----------------------------------------------------------------------------- random data


def warp(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature, top-k, top-p as vLLM's sampler applies them, one setting per row.

    ``logits`` [R, V]; ``temperature``/``top_k``/``top_p`` [R] (``top_k = V`` and
    ``top_p >= 1`` switch those off). Returns [R, V] probabilities with exact zeros.
    """
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).clamp(min=0)[:, None])
    logits = logits.masked_fill(logits < kth, -math.inf)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    # Keep the minimal prefix whose mass reaches top_p: drop where the mass before > p.
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) > top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf).softmax(-1)


def random_batch(
    seed: int,
    variant: str,
    max_batch: int = 64,
    max_spec_len: int | None = None,
    vocab: int | None = None,
) -> VerifyBatch:
    """A random ragged batch: 0..K drafts per request, mixed greedy/sampled requests,
    top-k/top-p-warped probabilities (zeros occur), tied logits, off-support drafts.

    Half the batches carry an explicit ``target_argmax`` that breaks exact ties in the
    probabilities towards the LAST maximum, as logits closer than float32 softmax
    resolution do in vLLM: a backend that took the argmax of the probabilities instead
    would disagree with the reference on those rows.
    """
    g = torch.Generator().manual_seed(seed)

    def rand() -> float:
        return float(torch.rand((), generator=g))

    def randint(lo: int, hi: int) -> int:  # inclusive
        return int(torch.randint(lo, hi + 1, (), generator=g))

    k = max_spec_len if max_spec_len is not None else randint(1, 8)
    v = vocab if vocab is not None else randint(2, 40)
    b = randint(1, max_batch)
    num = torch.randint(0, k + 1, (b,), generator=g)
    if rand() < 0.1:
        num[:] = 0  # a batch with no drafts at all
    t = int(num.sum())
    req = torch.repeat_interleave(torch.arange(b), num)
    greedy = torch.rand(b, generator=g) < 0.3

    def request_warps() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        temperature = 0.5 + torch.rand(b, generator=g)
        top_k = torch.randint(1, v + 1, (b,), generator=g)
        top_k = torch.where(torch.rand(b, generator=g) < 0.4, top_k, torch.full_like(top_k, v))
        top_p = 0.5 + 0.45 * torch.rand(b, generator=g)
        top_p = torch.where(torch.rand(b, generator=g) < 0.4, top_p, torch.full_like(top_p, 2.0))
        return temperature, top_k, top_p

    def probs_for(logits: torch.Tensor, owners: torch.Tensor, warps) -> torch.Tensor:
        return warp(logits, *(w[owners] for w in warps))

    def logits_like(n_rows: int) -> torch.Tensor:
        logits = torch.randn(n_rows, v, generator=g) * (0.5 + 2.5 * rand())
        if rand() < 0.3:
            logits = logits.round()  # exact ties, also in the argmax
        return logits

    target_warps, draft_warps = request_warps(), request_warps()
    target_logits = logits_like(t)
    target = probs_for(target_logits, req, target_warps)
    draft_logits = target_logits + 0.8 * torch.randn(t, v, generator=g)
    draft = probs_for(draft_logits, req, draft_warps)
    bonus = probs_for(logits_like(b), torch.arange(b), target_warps)

    target_argmax = None
    if rand() < 0.5:
        last_max = v - 1 - target.flip(-1).argmax(-1)
        target_argmax = last_max
    greedy_token = target.argmax(-1) if target_argmax is None else target_argmax

    if t:
        drafts = torch.multinomial(draft, 1, generator=g).squeeze(1)
    else:
        drafts = torch.zeros(0, dtype=torch.int64)
    r = torch.rand(t, generator=g)
    # Greedy requests: mostly the target argmax, so long accepted runs happen.
    drafts = torch.where(greedy[req] & (r < 0.7), greedy_token, drafts)
    # Any request: some arbitrary tokens (p = 0 and/or q = 0 happen) and -1 padding.
    arbitrary = torch.randint(0, v, (t,), generator=g)
    drafts = torch.where(~greedy[req] & (r < 0.12), arbitrary, drafts)
    drafts = torch.where((r > 0.98), torch.full_like(drafts, -1), drafts)
    cu = num.cumsum(0)
    uniforms = torch.rand(t, generator=g)
    noise = torch.empty(b, v).exponential_(generator=g)
    rule = "mtad" if variant == "mtad" else "standard"
    draft_probs = draft_token_probs = None
    tau = 1.0
    if variant == "standard":
        draft_probs = draft.float()
    elif variant == "mtad":
        q_tok = draft.gather(1, drafts.clamp(min=0)[:, None]).squeeze(1)
        draft_token_probs = torch.where(drafts >= 0, q_tok, torch.zeros_like(q_tok))
        tau = [1.0, 0.5, 0.1, 0.01, 1e-4][randint(0, 4)]
    return VerifyBatch(
        rule=rule,
        draft_token_ids=drafts,
        cu_num_draft_tokens=cu,
        target_probs=target.float(),
        bonus_probs=bonus.float(),
        is_greedy=greedy,
        uniforms=uniforms,
        exp_noise=noise,
        max_spec_len=k,
        target_argmax=target_argmax,
        draft_probs=draft_probs,
        draft_token_probs=draft_token_probs,
        acceptance_threshold=tau,
    )


def compare(batch: VerifyBatch, out: torch.Tensor, label: str = "") -> tuple[int, int]:
    """Assert ``out`` equals the reference on every non-fragile request.

    Returns (requests compared, requests skipped as fragile).
    """
    b = batch.bonus_probs.shape[0]
    assert tuple(out.shape) == (b, batch.max_spec_len + 1), out.shape
    assert out.dtype == torch.int64
    expected, fragile = reference_verify(batch)
    got = output_rows(out)
    compared = skipped = 0
    for i in range(b):
        if fragile[i]:
            skipped += 1
            continue
        compared += 1
        assert got[i] == expected[i], (
            f"{label} request {i}: got {got[i]}, reference {expected[i]} "
            f"(greedy={bool(batch.is_greedy[i])})"
        )
    return compared, skipped
