"""Train a SpecDec++ acceptance head for a (target, draft) pair: ``vllm-specx train-head``.

Recipe (Huang et al. 2024, "SpecDec++: Boosting Speculative Decoding via Adaptive
Candidate Lengths", section 3.3 and appendix C):

1. The target answers the training prompts in vLLM (:func:`~vllm_specx.training.data.
   generate_responses`): responses ``X_1..X_L``.
2. Teacher forcing on CPU with transformers, unwarped (temperature 1) probabilities: at every
   response position the draft samples one token ``Y_t ~ q_t``; its soft label is the
   probability that speculative sampling accepts it, ``min(1, p_t(Y_t) / q_t(Y_t))``
   (:func:`acceptance_labels`).
3. Token mixing (:func:`mix_tokens`): position t keeps the target's ``X_t`` with probability
   ``r`` (no loss there) and takes the draft's ``Y_t`` otherwise, so most inputs look like
   draft tokens, as they do while drafting. The draft is re-run on ``prompt + mixed`` and its
   final hidden state at the position of each ``Y_t`` (after the final norm: what its LM
   head reads, what the drafter passes to the head) is the feature for ``Y_t``'s label.
4. The head trains on those features with a soft binary cross-entropy weighted by ``w`` on
   the reject class (:func:`weighted_soft_bce`): accepted tokens dominate, and missing a
   rejection costs more than a needlessly short draft.

The held-out split is by response (no response contributes to both sides). The output
directory is a head (:func:`vllm_specx.algorithms.acceptance_head.save_head`) whose
``config.json`` names the draft (with its weights sha256), the recipe and the held-out
metrics; ``metrics.json`` keeps the per-epoch history.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_specx.training.data import Response

DRAFT_TOKEN_MODES = ("sampled", "greedy")


@dataclass(frozen=True)
class HeadTrainOptions:
    """Every knob of ``train-head`` (recorded in the head's config.json)."""

    seed: int = 0
    epochs: int = 3
    num_blocks: int = 3
    shared_blocks: bool = False
    reject_weight: float = 6.0
    mix_ratio: float = 0.15
    max_tokens: int = 128
    temperatures: tuple[float, ...] = (1.0,)
    heldout_fraction: float = 0.1
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    score_batch_size: int = 16
    threads: int = 1
    # "sampled": SpecDec++ (draft token drawn from q, soft label min(1, p/q)); "greedy": the
    # draft's argmax, label 1 when it is the target's argmax (what greedy requests verify).
    draft_tokens: str = "sampled"

    def check(self) -> None:
        """One clear line per bad value, before anything starts."""
        problems = [
            ("epochs", self.epochs, self.epochs >= 1, "an integer >= 1"),
            ("num_blocks", self.num_blocks, self.num_blocks >= 0, "an integer >= 0"),
            ("reject_weight", self.reject_weight, self.reject_weight > 0, "a number > 0"),
            ("mix_ratio", self.mix_ratio, 0 <= self.mix_ratio < 1, "a number in [0, 1)"),
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", list(self.temperatures),
             bool(self.temperatures) and all(t >= 0 for t in self.temperatures),
             "one or more numbers >= 0"),
            ("heldout_fraction", self.heldout_fraction, 0 < self.heldout_fraction < 1,
             "a number in (0, 1)"),
            ("batch_size", self.batch_size, self.batch_size >= 1, "an integer >= 1"),
            ("lr", self.lr, self.lr > 0, "a number > 0"),
            ("score_batch_size", self.score_batch_size, self.score_batch_size >= 1,
             "an integer >= 1"),
            ("threads", self.threads, self.threads >= 1, "an integer >= 1"),
            ("draft_tokens", self.draft_tokens, self.draft_tokens in DRAFT_TOKEN_MODES,
             " or ".join(DRAFT_TOKEN_MODES)),
        ]
        for name, value, ok, allowed in problems:
            if not ok:
                raise ValueError(f"train-head: {name}={value!r} is not allowed; allowed: {allowed}")


# --------------------------------------------------------------------------------------------
# Labels, mixing, loss: the pure pieces (tested against slow references).
# --------------------------------------------------------------------------------------------


def acceptance_labels(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor
) -> torch.Tensor:
    """``min(1, p_t(y_t) / q_t(y_t))`` per position: the probability that speculative sampling
    accepts draft token ``y_t`` drawn from ``q_t``. ``[L, V_p]``, ``[L, V_q]``, ``[L]`` ->
    ``[L]`` float32. A token outside the target's vocabulary has ``p = 0``; ``q_t(y_t) > 0``
    because ``y_t`` was drawn from ``q_t`` (a zero ``q`` gives label 1, as a draw that cannot
    happen carries no weight)."""
    y = draft_tokens.long().view(-1, 1)
    q = draft_probs.float().gather(1, y).squeeze(1)
    in_vocab = y.squeeze(1) < target_probs.shape[1]
    p = target_probs.float().gather(1, y.clamp(max=target_probs.shape[1] - 1)).squeeze(1)
    p = torch.where(in_vocab, p, torch.zeros_like(p))
    ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(torch.float32).tiny),
                        torch.ones_like(p))
    return ratio.clamp(max=1.0)


def greedy_acceptance_labels(
    target_probs: torch.Tensor, draft_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(draft_tokens, labels)`` for greedy drafting: the draft's argmax per position and 1.0
    where it equals the target's argmax (greedy verification accepts exactly then)."""
    y = draft_probs.argmax(dim=-1)
    return y, (target_probs.argmax(dim=-1) == y).float()


def mix_tokens(
    target_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    mix_ratio: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mixed, keep_target)``: each position keeps the target's token with probability
    ``mix_ratio`` (``keep_target`` True: no loss there) and takes the draft's otherwise."""
    keep_target = torch.rand(target_tokens.shape, generator=generator) < mix_ratio
    mixed = torch.where(keep_target, target_tokens, draft_tokens)
    return mixed, keep_target


def weighted_soft_bce(
    logits: torch.Tensor, labels: torch.Tensor, reject_weight: float
) -> torch.Tensor:
    """Soft binary cross-entropy, the reject class weighted by ``reject_weight``:

    ``sum(w (1-a) (-log P_reject) + a (-log P_accept)) / sum(w (1-a) + a)``

    over rows with logits ``[N, 2]`` (class 0 reject, 1 accept) and soft labels ``a`` ``[N]``
    (the weighted mean, so the value does not scale with ``w``)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    a = labels.float()
    w_rej = reject_weight * (1.0 - a)
    total = -(w_rej * logp[:, 0] + a * logp[:, 1]).sum()
    return total / (w_rej + a).sum().clamp_min(1e-12)


# --------------------------------------------------------------------------------------------
# Teacher-forced scoring with transformers.
# --------------------------------------------------------------------------------------------


@dataclass
class HeadData:
    """Features for the head: one row per draft token that is trained on."""

    features: torch.Tensor  # [N, H] draft final hidden state at the draft token's position
    labels: torch.Tensor  # [N] min(1, p/q)
    response_index: torch.Tensor  # [N] which response the row came from
    stats: dict[str, Any] = field(default_factory=dict)
    # The draft's own confidence in each row's token (training-free stop signals, same rows):
    # token_prob q(y), max_prob max q, top2_margin top-1 minus top-2 of q.
    signals: dict[str, torch.Tensor] = field(default_factory=dict)


def pad_sequences(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one right-padded ``[B, max_len]`` id tensor and its attention mask
    (1 on tokens, 0 on padding)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    return ids, mask


def _decoder(model: nn.Module) -> nn.Module:
    # The causal LM's body: its last_hidden_state is after the final norm, the LM head's input.
    body = getattr(model, "model", None)
    return body if isinstance(body, nn.Module) else model.get_decoder()


def response_generator(seed: int, index: int) -> torch.Generator:
    """The generator of response ``index``: draws do not depend on batching or order."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def score_responses(
    target_model: nn.Module,
    draft_model: nn.Module,
    responses: list[Response],
    *,
    mix_ratio: float,
    seed: int,
    batch_size: int = 16,
    pad_id: int = 0,
    progress: bool = True,
    draft_tokens: str = "sampled",
) -> HeadData:
    """SpecDec++ training rows for ``responses`` (module doc, steps 2-3); ``draft_tokens``
    "greedy" labels the draft's argmax by agreement with the target's argmax instead."""
    if draft_tokens not in DRAFT_TOKEN_MODES:
        raise ValueError(f"draft_tokens={draft_tokens!r} is not allowed; allowed: "
                         f"{' or '.join(DRAFT_TOKEN_MODES)}")
    from tqdm.auto import tqdm

    feats, labels, index = [], [], []
    signals: dict[str, list[torch.Tensor]] = {"token_prob": [], "max_prob": [], "top2_margin": []}
    n_positions = n_kept = 0
    label_sum_all = 0.0
    bar = tqdm(total=len(responses), desc="score", disable=not progress, unit="resp")
    for start in range(0, len(responses), batch_size):
        chunk = [(start + k, r) for k, r in enumerate(responses[start:start + batch_size])
                 if r.response_ids]
        bar.update(min(batch_size, len(responses) - start))
        if not chunk:
            continue
        ids, mask = pad_sequences([r.prompt_ids + r.response_ids for _, r in chunk], pad_id)
        with torch.no_grad():
            p_logits = target_model(input_ids=ids, attention_mask=mask).logits.float()
            q_logits = draft_model(input_ids=ids, attention_mask=mask).logits.float()
        mixed_seqs, keeps = [], []
        for b, (i, r) in enumerate(chunk):
            n_p, n_r = len(r.prompt_ids), len(r.response_ids)
            # Position n_p - 1 + t predicts response token t.
            sl = slice(n_p - 1, n_p - 1 + n_r)
            p = torch.softmax(p_logits[b, sl], dim=-1)
            q = torch.softmax(q_logits[b, sl], dim=-1)
            gen = response_generator(seed, i)
            if draft_tokens == "greedy":
                y, a = greedy_acceptance_labels(p, q)
            else:
                y = torch.multinomial(q, 1, generator=gen).squeeze(1)
                a = acceptance_labels(p, q, y)
            x = torch.tensor(r.response_ids, dtype=torch.long)
            mixed, keep_target = mix_tokens(x, y, mix_ratio, gen)
            mixed_seqs.append(r.prompt_ids + mixed.tolist())
            top2 = q.topk(min(2, q.shape[-1]), dim=-1).values
            conf = {
                "token_prob": q.gather(1, y.view(-1, 1)).squeeze(1),
                "max_prob": top2[:, 0],
                "top2_margin": top2[:, 0] - (top2[:, 1] if top2.shape[1] > 1 else 0.0),
            }
            keeps.append((a, keep_target, conf))
            n_positions += n_r
            label_sum_all += float(a.sum())
        mids, mmask = pad_sequences(mixed_seqs, pad_id)
        with torch.no_grad():
            hidden = _decoder(draft_model)(input_ids=mids, attention_mask=mmask)
            hidden = hidden.last_hidden_state.float()
        for b, (i, r) in enumerate(chunk):
            a, keep_target, conf = keeps[b]
            n_p, n_r = len(r.prompt_ids), len(r.response_ids)
            h = hidden[b, n_p:n_p + n_r]  # hidden after feeding mixed token t
            train = ~keep_target
            feats.append(h[train])
            labels.append(a[train])
            for name, values in conf.items():
                signals[name].append(values[train])
            index.append(torch.full((int(train.sum()),), i, dtype=torch.long))
            n_kept += int(keep_target.sum())
    bar.close()
    hidden_size = int(_decoder(draft_model).config.hidden_size)
    data = HeadData(
        features=torch.cat(feats) if feats else torch.zeros(0, hidden_size),
        labels=torch.cat(labels) if labels else torch.zeros(0),
        response_index=torch.cat(index) if index else torch.zeros(0, dtype=torch.long),
        signals={k: torch.cat(v) if v else torch.zeros(0) for k, v in signals.items()},
    )
    data.stats = {
        "responses": len(responses),
        "positions": n_positions,
        "target_token_positions_no_loss": n_kept,
        "rows": int(data.labels.numel()),
        "mean_accept_prob_all_positions": label_sum_all / max(1, n_positions),
    }
    return data


# --------------------------------------------------------------------------------------------
# Training and evaluation.
# --------------------------------------------------------------------------------------------


def split_responses(n: int, heldout_fraction: float, seed: int) -> tuple[set[int], set[int]]:
    """(train, held-out) response indices: a seeded permutation, at least one each when n >= 2."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = min(n - 1, max(1, round(heldout_fraction * n))) if n >= 2 else 0
    return set(perm[n_held:]), set(perm[:n_held])


def head_metrics(
    head: nn.Module, features: torch.Tensor, labels: torch.Tensor, reject_weight: float
) -> dict[str, float]:
    """Loss (the training loss), unweighted soft BCE, soft AUC and calibration numbers."""
    from vllm_specx.training.loop import soft_auc

    with torch.no_grad():
        logits = head(features).float()
    prob = torch.softmax(logits, dim=-1)[:, 1]
    mean_label = float(labels.float().mean()) if labels.numel() else float("nan")
    const = torch.tensor([[0.0, 0.0]]).expand(labels.numel(), 2).clone()
    # The constant predictor with the best unweighted BCE predicts the mean label.
    m = min(max(mean_label, 1e-6), 1 - 1e-6)
    const[:, 1] = torch.logit(torch.tensor(m))
    return {
        "loss": float(weighted_soft_bce(logits, labels, reject_weight)),
        "bce": float(weighted_soft_bce(logits, labels, 1.0)),
        "bce_constant_predictor": float(weighted_soft_bce(const, labels, 1.0)),
        "auc": soft_auc(prob, labels),
        "mean_label": mean_label,
        "mean_predicted_accept": float(prob.mean()) if prob.numel() else float("nan"),
        "rows": int(labels.numel()),
    }


def train_head_on_data(
    train: HeadData,
    heldout: HeadData,
    options: HeadTrainOptions,
    *,
    progress: bool = True,
    log: Any = print,
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """A fresh head trained on ``train`` rows; per-epoch held-out metrics in the history."""
    from vllm_specx.algorithms.acceptance_head import AcceptanceHead
    from vllm_specx.training.loop import train_loop

    torch.manual_seed(options.seed)
    head = AcceptanceHead(int(train.features.shape[1]), options.num_blocks, options.shared_blocks)
    w = options.reject_weight

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, a = batch
        return weighted_soft_bce(model(x), a, w)

    def evaluate(model: nn.Module) -> dict[str, float]:
        m = head_metrics(model, heldout.features, heldout.labels, w)
        return {"heldout_loss": m["loss"], "heldout_auc": m["auc"]}

    history = train_loop(
        head, (train.features, train.labels), loss_fn,
        epochs=options.epochs, batch_size=options.batch_size, lr=options.lr,
        seed=options.seed, weight_decay=options.weight_decay,
        evaluate=evaluate if heldout.labels.numel() else None,
        desc="train-head", progress=progress, log=log,
    )
    return head, history


def _subset(data: HeadData, keep: set[int]) -> HeadData:
    mask = torch.tensor([int(i) in keep for i in data.response_index.tolist()], dtype=torch.bool)
    return HeadData(data.features[mask], data.labels[mask], data.response_index[mask],
                    signals={k: v[mask] for k, v in data.signals.items()})


def signal_aucs(data: HeadData) -> dict[str, float]:
    """AUC of each training-free confidence signal on ``data``'s rows (compare with the
    head's: same rows, same labels)."""
    from vllm_specx.training.loop import soft_auc

    return {name: soft_auc(values, data.labels) for name, values in data.signals.items()}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def generate_head_responses(
    target: str | os.PathLike, prompts: list[str], options: HeadTrainOptions, *,
    engine_args: dict[str, Any] | None, log: Any,
) -> tuple[list[Response], float]:
    """Step 1: the target answers the prompts in vLLM at every temperature; returns the
    responses and the seconds it took."""
    from vllm_specx.training.data import generate_responses

    t0 = time.time()
    responses = generate_responses(
        target, prompts, temperatures=list(options.temperatures),
        max_tokens=options.max_tokens, seed=options.seed,
        engine_args={"torch_threads": options.threads, **(engine_args or {})},
    )
    seconds = time.time() - t0
    n_tokens = sum(len(r.response_ids) for r in responses)
    log(f"generated {len(responses)} responses, {n_tokens} tokens in {seconds:.1f}s")
    return responses, seconds


def score_with_models(
    target: str | os.PathLike, draft: str | os.PathLike, responses: list[Response],
    options: HeadTrainOptions, *, progress: bool, log: Any,
) -> tuple[HeadData, float]:
    """Step 2: load the target and the draft in transformers and score the responses
    (:func:`score_responses`); returns the head's rows and the seconds it took."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.time()
    hf_logging.disable_progress_bar()
    target_model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    draft_model = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    data = score_responses(
        target_model, draft_model, responses, mix_ratio=options.mix_ratio, seed=options.seed,
        batch_size=options.score_batch_size, pad_id=pad_id, progress=progress,
        draft_tokens=options.draft_tokens,
    )
    del target_model, draft_model
    seconds = time.time() - t0
    log(f"scored: {json.dumps(data.stats)} in {seconds:.1f}s")
    return data, seconds


def fit_and_measure_head(
    data: HeadData, num_responses: int, options: HeadTrainOptions, *, progress: bool,
    log: Any,
) -> tuple[nn.Module, list[dict[str, Any]], dict[str, Any], float]:
    """Step 3: split by response, train the head, measure it on both splits (and the
    draft's own confidence signals on the held-out rows). Returns (head, per-epoch
    history, metrics, training seconds)."""
    train_idx, held_idx = split_responses(num_responses, options.heldout_fraction, options.seed)
    train, heldout = _subset(data, train_idx), _subset(data, held_idx)
    if train.labels.numel() == 0:
        raise ValueError("train-head: no training rows (too few prompts or tokens)")
    t0 = time.time()
    head, history = train_head_on_data(train, heldout, options, progress=progress, log=log)
    seconds = time.time() - t0
    metrics = {
        "heldout": head_metrics(head, heldout.features, heldout.labels, options.reject_weight),
        "train": head_metrics(head, train.features, train.labels, options.reject_weight),
    }
    metrics["heldout"]["responses"] = len(held_idx)
    metrics["heldout"]["confidence_signal_auc"] = signal_aucs(heldout)
    metrics["train"]["responses"] = len(train_idx)
    return head, history, metrics, seconds


def head_training_record(
    options: HeadTrainOptions, prompts_file: str | os.PathLike, num_prompts: int,
    data: HeadData, seconds: dict[str, float],
) -> dict[str, Any]:
    """The ``training`` section of the head's metadata: recipe, options, prompts, data,
    times and versions."""
    from vllm_specx.training.data import sha256_of_files

    prompts_path = Path(prompts_file)
    return {
        "recipe": "SpecDec++ (soft labels min(1, p/q), token mixing, weighted soft BCE)"
        if options.draft_tokens == "sampled" else "SpecDec++ with greedy draft tokens "
        "(label: draft argmax == target argmax), token mixing, weighted soft BCE",
        "options": {k: (list(v) if isinstance(v, tuple) else v)
                    for k, v in dataclasses.asdict(options).items()},
        "prompts": {"file": prompts_path.name, "sha256": sha256_of_files([prompts_path]),
                    "count": num_prompts},
        "data": data.stats,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }


def train_head(
    target: str | os.PathLike,
    draft: str | os.PathLike,
    prompts_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    options: HeadTrainOptions = HeadTrainOptions(),
    *,
    max_prompts: int | None = None,
    engine_args: dict[str, Any] | None = None,
    progress: bool = True,
    log: Any = _log,
) -> dict[str, Any]:
    """The whole ``train-head`` pipeline (generate, score, fit, write); returns the config
    written next to the head."""
    from vllm_specx.algorithms.acceptance_head import save_head
    from vllm_specx.training.data import model_summary, read_prompt_file

    options.check()
    t_start = time.time()
    torch.set_num_threads(options.threads)  # before the engine: vLLM pins it afterwards
    prompts = read_prompt_file(prompts_file)
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    log(f"train-head: {len(prompts)} prompts x temperatures {list(options.temperatures)}, "
        f"max_tokens {options.max_tokens}, target {target}, draft {draft}")
    responses, t_generate = generate_head_responses(target, prompts, options,
                                                    engine_args=engine_args, log=log)
    data, t_score = score_with_models(target, draft, responses, options, progress=progress,
                                      log=log)
    head, history, metrics, t_train = fit_and_measure_head(
        data, len(responses), options, progress=progress, log=log)
    seconds = {"generate": t_generate, "score": t_score, "train": t_train,
               "total": time.time() - t_start}
    head.meta = {
        "draft_model": model_summary(draft),
        "target_model": model_summary(target),
        "training": head_training_record(options, prompts_file, len(prompts), data, seconds),
        "metrics": metrics,
    }
    out = save_head(head, out_dir)
    (out / "metrics.json").write_text(json.dumps({"history": history, **metrics}, indent=2) + "\n")
    h = metrics["heldout"]
    log(f"held-out: loss {h['loss']:.4f}, AUC {h['auc']:.4f}, BCE {h['bce']:.4f} (constant "
        f"predictor {h['bce_constant_predictor']:.4f}), {h['rows']} rows; AUC of the draft's "
        "own confidence on the same rows: " + ", ".join(
            f"{k} {v:.4f}" for k, v in h["confidence_signal_auc"].items())
        + f"; head written to {out}")
    return head.config_dict()
