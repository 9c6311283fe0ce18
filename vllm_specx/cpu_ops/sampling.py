"""Token sampling ops of vLLM's CPU sampler: ``greedy_argmax``, ``fused_gumbel_argmax``."""

from __future__ import annotations

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


def fused_gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from ``softmax(logits)`` by the Gumbel-max trick.

    ``seeds[i]`` keys row ``i``'s noise, so a seeded request reproduces its draw.
    Tokens whose logit is ``-inf`` (filtered by top-k/top-p) are never chosen; an
    all ``-inf`` row yields token 0.
    """
    x = logits.reshape(-1, logits.shape[-1]).to(torch.float64)
    noisy = x + gumbel_noise(seeds, x.shape[-1])
    return noisy.argmax(dim=-1)
