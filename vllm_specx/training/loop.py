"""A small, seeded training loop and binary-classification metrics.

:func:`train_loop` trains any module on in-memory tensors: a seeded shuffle per epoch, AdamW
with linear warm-up then cosine decay, a tqdm progress bar, and an optional evaluation after
every epoch. Same seed, same inputs, same torch thread count: same weights. ``train-head``
(acceptance heads) and ``distill`` (draft models) both train through it; the optional
knobs (step budget, gradient clipping, a floor under the cosine, bf16 autocast, no weight
decay on norm gains) default to off, so a caller that does not name them trains as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def train_loop(
    model: nn.Module,
    tensors: Sequence[torch.Tensor],
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    weight_decay: float = 0.0,
    warmup_frac: float = 0.05,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    desc: str = "train",
    progress: bool = True,
    log: Callable[[str], None] = print,
    max_steps: int | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    grad_clip: float | None = None,
    min_lr_ratio: float = 0.0,
    decay_1d: bool = True,
    autocast_bf16: bool = False,
) -> list[dict[str, Any]]:
    """Train ``model`` on rows of ``tensors`` (same first dimension); return per-epoch logs.

    ``loss_fn(model, batch)`` gets one tuple of row-sliced tensors and returns a scalar.
    ``evaluate(model)`` (called in eval mode, without gradients) returns metrics logged after
    each epoch.

    ``max_steps`` stops after that many optimiser steps (the schedule spans them), even in
    the middle of an epoch; ``epochs`` is then an upper bound. ``grad_clip`` clips the global
    gradient norm; ``min_lr_ratio`` is the floor of the cosine as a fraction of ``lr``;
    ``decay_1d=False`` exempts 1-D parameters (norm gains, biases) from weight decay;
    ``autocast_bf16`` runs the forward under CPU bf16 autocast (weights, gradients and
    optimiser state stay float32).
    """
    from tqdm.auto import tqdm

    n = int(tensors[0].shape[0])
    if any(int(t.shape[0]) != n for t in tensors):
        raise ValueError("train_loop: every tensor needs the same number of rows")
    if n == 0:
        raise ValueError("train_loop: no training rows")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs={epochs}, batch_size={batch_size}: both must be >= 1")
    steps_per_epoch = math.ceil(n / batch_size)
    total = epochs * steps_per_epoch
    if max_steps is not None:
        if max_steps < 1:
            raise ValueError(f"max_steps={max_steps}: must be >= 1")
        total = min(total, max_steps)
        epochs = math.ceil(total / steps_per_epoch)
    warmup = max(1, int(warmup_frac * total)) if warmup_frac > 0 else 0

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress_frac = (step - warmup) / max(1, total - warmup)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress_frac))

    if decay_1d:
        groups: Any = model.parameters()
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(seed)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=total, desc=desc, disable=not progress, unit="step")
    step = 0
    for epoch in range(epochs):
        t0 = time.time()
        model.train()
        order = torch.randperm(n, generator=gen)
        loss_sum, seen = 0.0, 0
        for s in range(steps_per_epoch):
            if step == total:
                break
            idx = order[s * batch_size:(s + 1) * batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
                loss = loss_fn(model, tuple(t[idx] for t in tensors))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            step += 1
            sched.step()
            loss_sum += float(loss.detach()) * idx.numel()
            seen += idx.numel()
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum / seen:.4f}")
        entry: dict[str, Any] = {
            "epoch": epoch + 1,
            "train_loss": loss_sum / seen,
            "seconds": round(time.time() - t0, 2),
        }
        if evaluate is not None:
            model.eval()
            with torch.no_grad():
                entry.update(evaluate(model))
        history.append(entry)
        log(f"{desc} epoch {epoch + 1}/{epochs}: "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in entry.items() if k != "epoch"))
    bar.close()
    model.eval()
    return history


def soft_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC with soft labels: row i counts as a positive with weight ``labels[i]`` and as
    a negative with weight ``1 - labels[i]``; AUC = P(score of a positive > score of a
    negative) over all weighted (positive, negative) pairs of distinct rows, ties counted 1/2.

    With 0/1 labels this is the usual AUC. O(n log n).
    """
    s = scores.detach().double().flatten()
    y = labels.detach().double().flatten()
    if s.numel() != y.numel():
        raise ValueError("soft_auc: scores and labels differ in size")
    pos, neg = y, 1.0 - y
    # Same-row pairs are not comparisons of two rows: drop them from the denominator.
    denom = float(pos.sum() * neg.sum() - (pos * neg).sum())
    if denom <= 0:
        return float("nan")
    order = torch.argsort(s)
    s, pos, neg = s[order], pos[order], neg[order]
    # Group equal scores: each positive beats the negatives of strictly lower groups and
    # ties half of its own group's negatives (minus its own negative weight).
    uniq, inverse = torch.unique_consecutive(s, return_inverse=True)
    g_neg = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, neg)
    below = torch.cumsum(g_neg, 0) - g_neg
    wins = (pos * (below[inverse] + 0.5 * (g_neg[inverse] - neg))).sum()
    return float(wins / denom)
