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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class StepPlan:
    """How many optimiser steps a run takes: ``total`` steps over ``epochs`` epochs of at
    most ``steps_per_epoch`` steps, the first ``warmup`` of them warming up."""

    steps_per_epoch: int
    total: int
    epochs: int
    warmup: int


def plan_steps(n: int, *, epochs: int, batch_size: int, max_steps: int | None,
               warmup_frac: float) -> StepPlan:
    """The step plan for ``n`` rows (``max_steps`` caps the total and may end an epoch
    early; ``epochs`` is then an upper bound), or a ValueError naming the bad value."""
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
    return StepPlan(steps_per_epoch, total, epochs, warmup)


def lr_multiplier(plan: StepPlan, min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` (a fraction of the lr) over
    the plan's steps: step -> factor on the learning rate."""

    def schedule(step: int) -> float:
        if step < plan.warmup:
            return (step + 1) / plan.warmup
        progress_frac = (step - plan.warmup) / max(1, plan.total - plan.warmup)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress_frac))

    return schedule


def adamw(model: nn.Module, *, lr: float, weight_decay: float,
          betas: tuple[float, float], decay_1d: bool) -> torch.optim.AdamW:
    """AdamW over the model's parameters; ``decay_1d=False`` exempts 1-D parameters (norm
    gains, biases) from weight decay."""
    if decay_1d:
        groups: Any = model.parameters()
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas)


def train_steps(
    model: nn.Module,
    tensors: Sequence[torch.Tensor],
    loss_fn: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor],
    batches: Sequence[torch.Tensor],
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    *,
    grad_clip: float | None = None,
    autocast_bf16: bool = False,
    on_step: Callable[[float], None] | None = None,
    device: str = "cpu",
) -> tuple[float, int]:
    """One optimiser step per batch (row indices into ``tensors``); returns the
    row-weighted loss sum and the rows seen. ``on_step(mean loss so far)`` after each.
    ``tensors`` stay where they are (the CPU); each batch's rows are moved to ``device``,
    where ``model`` must already be."""
    model.train()
    loss_sum, seen = 0.0, 0
    for idx in batches:
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                            enabled=autocast_bf16):
            loss = loss_fn(model, tuple(t[idx].to(device) for t in tensors))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        loss_sum += float(loss.detach()) * idx.numel()
        seen += idx.numel()
        if on_step is not None:
            on_step(loss_sum / seen)
    return loss_sum, seen


def epoch_summary(desc: str, epochs: int, entry: dict[str, Any]) -> str:
    """The log line of one epoch's entry."""
    return (f"{desc} epoch {entry['epoch']}/{epochs}: "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in entry.items() if k != "epoch"))


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
    device: str = "cpu",
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
    plan = plan_steps(n, epochs=epochs, batch_size=batch_size, max_steps=max_steps,
                      warmup_frac=warmup_frac)
    opt = adamw(model, lr=lr, weight_decay=weight_decay, betas=betas, decay_1d=decay_1d)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(plan, min_lr_ratio))
    gen = torch.Generator().manual_seed(seed)
    history: list[dict[str, Any]] = []
    bar = tqdm(total=plan.total, desc=desc, disable=not progress, unit="step")

    def on_step(mean_loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}")

    for epoch in range(plan.epochs):
        t0 = time.time()
        order = torch.randperm(n, generator=gen)
        # The last epoch may stop early: the plan's total is reached.
        steps = min(plan.steps_per_epoch, plan.total - epoch * plan.steps_per_epoch)
        batches = [order[s * batch_size:(s + 1) * batch_size] for s in range(steps)]
        loss_sum, seen = train_steps(model, tensors, loss_fn, batches, opt, sched,
                                     grad_clip=grad_clip, autocast_bf16=autocast_bf16,
                                     on_step=on_step, device=device)
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
        log(epoch_summary(desc, plan.epochs, entry))
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
