"""Token sampling ops of vLLM's CPU sampler: ``greedy_argmax``, ``fused_gumbel_argmax``."""

from __future__ import annotations

import threading

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # golden-ratio increment of the SplitMix64 sequence
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _as_int64(x: int) -> int:
    """The int64 whose bit pattern is the uint64 ``x`` (torch has no uint64 math)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors that hold uint64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser; int64 multiplication wraps like uint64 multiplication."""
    z = (z ^ _shr(z, 30)) * _as_int64(_MIX1)
    z = (z ^ _shr(z, 27)) * _as_int64(_MIX2)
    return z ^ _shr(z, 31)


def gumbel_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise ``[len(seeds), vocab_size]`` in float64, one independent
    counter-based stream per (seed, token): the same seed always gives the same noise,
    and no state is shared between rows or tokens."""
    key = _mix64(seeds.to(torch.int64).reshape(-1, 1))
    idx = torch.arange(1, vocab_size + 1, dtype=torch.int64)
    bits = _shr(_mix64(key + idx * _as_int64(_GAMMA)), 11)  # 53 random bits
    u = (bits.to(torch.float64) + 0.5) * 2.0**-53  # uniform in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax ``[rows] int64``; ties pick the lowest index."""
    return logits.argmax(dim=-1).view(-1)


# Rows per chunk of fused_gumbel_argmax: its int64/float64 work buffers are reused between
# calls (ROWS_PER_CHUNK x vocab x 8 bytes each, ~3 MB at a 49k vocabulary), not allocated
# per call. Why: allocated per call (several [rows, vocab] temporaries of 8-byte values)
# glibc hands them out by mmap and takes them back, and every call page-faults them in
# again: at 8 rows x 49152 that was 14.6 ms a call alone, half of it in the kernel (4,400
# page faults), and 5-6 ms inside an engine, varying with the process's heap: in a
# speculative engine it ran 20% slower than in a plain one for the same work.
ROWS_PER_CHUNK = 8
_per_thread = threading.local()  # each thread its own buffers (.workspaces: vocab -> them)


def _workspace(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two ``[ROWS_PER_CHUNK, vocab]`` int64 buffers and each token's counter step
    ``(token + 1) * GAMMA`` (int64, wrapping), made once per vocabulary size and thread."""
    workspaces = getattr(_per_thread, "workspaces", None)
    if workspaces is None:
        workspaces = _per_thread.workspaces = {}
    work = workspaces.get(vocab_size)
    if work is None:
        step = torch.arange(1, vocab_size + 1, dtype=torch.int64) * _as_int64(_GAMMA)
        work = (torch.empty(ROWS_PER_CHUNK, vocab_size, dtype=torch.int64),
                torch.empty(ROWS_PER_CHUNK, vocab_size, dtype=torch.int64), step)
        workspaces[vocab_size] = work
    return work


def _shr_into(x: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`_shr` written into ``out``."""
    torch.bitwise_right_shift(x, n, out=out)
    return out.bitwise_and_((1 << (64 - n)) - 1)


def fused_gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from ``softmax(logits)`` by the Gumbel-max trick.

    ``seeds[i]`` keys row ``i``'s noise, so a seeded request reproduces its draw.
    Tokens whose logit is ``-inf`` (filtered by top-k/top-p) are never chosen; an
    all ``-inf`` row yields token 0.

    Bit for bit ``argmax(logits.double() + gumbel_noise(seeds, vocab))`` (the same
    operations in the same order), computed :data:`ROWS_PER_CHUNK` rows at a time in
    reused buffers (see there why)."""
    x = logits.reshape(-1, logits.shape[-1])
    rows, vocab = x.shape
    keys = _mix64(seeds.to(torch.int64).reshape(-1, 1))
    z_all, t_all, step = _workspace(vocab)
    out = torch.empty(rows, dtype=torch.int64)
    for start in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - start)
        z, t = z_all[:n], t_all[:n]
        torch.add(keys[start:start + n], step, out=z)  # key + (token + 1) * GAMMA
        # _mix64(z) in place (t: the shifted copy)
        z.bitwise_xor_(_shr_into(z, 30, t)).mul_(_as_int64(_MIX1))
        z.bitwise_xor_(_shr_into(z, 27, t)).mul_(_as_int64(_MIX2))
        z.bitwise_xor_(_shr_into(z, 31, t))
        bits = _shr_into(z, 11, t)  # 53 random bits
        u = z.view(torch.float64)  # z's bits are spent: its storage holds the noise
        u.copy_(bits).add_(0.5).mul_(2.0**-53)
        noise = u.log_().neg_().log_().neg_()  # -log(-log(u)), standard Gumbel
        torch.argmax(torch.add(x[start:start + n], noise, out=noise), dim=-1,
                      out=out[start:start + n])
    return out
