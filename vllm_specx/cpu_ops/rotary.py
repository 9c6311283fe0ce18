"""Rotary positional embedding (``_C::rotary_embedding``), in place."""

from __future__ import annotations

import torch


def _rotate_(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_size: int,
    rot_dim: int,
    offset: int,
    is_neox: bool,
) -> None:
    num_tokens = cos.shape[0]
    heads = x.view(num_tokens, -1, head_size)  # a view: writes land in ``x``
    part = heads[..., offset : offset + rot_dim]
    half = rot_dim // 2
    c = cos[:, None, :]
    s = sin[:, None, :]
    if is_neox:
        # GPT-NeoX: the rotated pairs are (i, i + rot_dim / 2). As one product over the
        # whole rotated part: [x1 | x2] * [c | c] + [x2 | x1] * [-s | s], i.e.
        # x1 c - x2 s and x2 c + x1 s (the same IEEE results), in a third of the ops,
        # which is what a small model's step pays for here.
        x = part.to(c.dtype)
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        part.copy_(x * torch.cat((c, c), dim=-1) + swapped * torch.cat((-s, s), dim=-1))
    else:
        # GPT-J: the rotated pairs are interleaved (2i, 2i + 1).
        x1 = part[..., 0::2].to(c.dtype)
        x2 = part[..., 1::2].to(c.dtype)
        new1 = x1 * c - x2 * s
        new2 = x2 * c + x1 * s
        part[..., 0::2] = new1.to(part.dtype)
        part[..., 1::2] = new2.to(part.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """Rotate dims ``[rope_dim_offset, rope_dim_offset + rot_dim)`` of every head.

    ``rot_dim`` is ``cos_sin_cache.shape[1]`` (the cache rows are ``[cos | sin]`` of
    ``rot_dim / 2`` each). ``query``/``key`` are ``[..., heads * head_size]`` or
    ``[..., heads, head_size]`` with one leading entry per position; ``inverse``
    rotates by ``-theta`` (undoes a forward rotation).
    """
    pos = positions.reshape(-1).to(torch.int64)
    rot_dim = cos_sin_cache.shape[1]
    if rope_dim_offset + rot_dim > head_size:
        raise ValueError(f"{rope_dim_offset=} + rot_dim={rot_dim} exceeds {head_size=}")
    cos_sin = cos_sin_cache.index_select(0, pos)
    # Compute in at least float32 so low-precision caches do not lose the rotation.
    cdt = torch.promote_types(cos_sin.dtype, torch.float32)
    cos, sin = cos_sin.to(cdt).chunk(2, dim=-1)
    if inverse:
        sin = -sin
    _rotate_(query, cos, sin, head_size, rot_dim, rope_dim_offset, is_neox)
    if key is not None:
        _rotate_(key, cos, sin, head_size, rot_dim, rope_dim_offset, is_neox)
