"""Train a draft model for a target by self-distillation: ``vllm-specx distill``.

Recipe (Yi et al., "Towards Fast Multilingual LLM Inference: Speculative Decoding and
Specialized Drafters"): the drafter that decides the speed-up is the one
trained on what the target itself says. Stages, in the order they run, each resumable (a
stage whose completion marker in the work directory records the same inputs is skipped, so
an interrupted run continues where it stopped):

``pretrain`` (only with a corpus)
    Language-model training on random windows of raw text (every file of the corpus,
    tokenized with the target's tokenizer, bos + tokens + eos per file), each window
    ``bos + seq_len - 1`` tokens, so "bos" means "start of context" as at inference.
``data``
    The target answers the prompts in the real vLLM engine at every temperature (default
    0, 0.3, 0.7, 1.0; :func:`~vllm_specx.training.data.generate_responses`, shared with
    ``train-head``). A seeded fraction of the PROMPTS is held out (all of its responses), for
    the report only. With ``finetune_steps == 0`` (a raw-text-only drafter, the baseline of
    the paper's comparison of distilled and raw-text drafters) only the held-out prompts
    are answered (or a distilled run's data is reused: its held-out answers are the same
    requests, which come first).
``finetune``
    Training on the target's continuations of the training prompts (loss on the generated
    tokens only, prompt tokens are context), then the drafter is written to the output
    directory: config.json, generation_config.json, model.safetensors and the target's
    tokenizer files, a Hugging Face directory that ``draft_model``, ``mtad`` and ``adaptive``
    load as it is.
``report``
    ``REPORT.json`` in the output directory, from the SAVED drafter (reloaded as a user
    would) on the held-out responses, teacher-forced in transformers: agreement of the
    draft's greedy token with the target's greedy token; greedy block efficiency (tokens per
    target forward) for K = 1, 2, 4, 8 along the target's greedy continuations; the expected
    acceptance rate of standard speculative sampling at temperature 1 (``sum_x min(p, q)``);
    the draft's perplexity on the target's text; plus sizes, times, options and versions.

Each stage is a function of a :class:`DistillRun` (:func:`run_pretrain`, :func:`run_data`,
:func:`run_finetune`, :func:`run_report`); :func:`resume_stages` is the one place that
decides which run and which are skipped.

Both training stages run through :func:`vllm_specx.training.loop.train_loop` (shared with
``train-head``). Deterministic for a seed on one machine and thread count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm_specx.training.data import Response

# In the order they run: pretraining needs no data, so it runs (and can be stopped after)
# before the target's engine starts.
STAGES = ("pretrain", "data", "finetune", "report")
SAVE_DTYPES = ("float32", "bfloat16", "float16")
EMBED_INITS = ("random", "target")
AUTOCAST_MODES = ("auto", "bf16", "off")
DEVICES = ("cpu", "cuda", "auto")
# Files of a Hugging Face tokenizer, copied from the target so the drafter is self-contained.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja",
)
CORPUS_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".html", ".c", ".h")


@dataclass(frozen=True)
class DraftShape:
    """A Llama drafter's shape (the vocabulary and token ids come from the target)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def label(self) -> str:
        return f"{self.hidden}x{self.layers}"


# Named sizes; "small" is the fixture draft's shape.
DRAFT_SIZES: dict[str, DraftShape] = {
    "tiny": DraftShape(hidden=32, layers=1, heads=1, kv_heads=1, intermediate=64),
    "small": DraftShape(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384),
    "base": DraftShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768),
}
SIZE_HELP = (
    "a named size (" + ", ".join(f"{k} = {v.label()}" for k, v in DRAFT_SIZES.items())
    + ") or HIDDENxLAYERS, e.g. 192x2 (heads of 64, or one head below 64; half as many "
    "key/value heads; MLP width 3 x hidden)"
)


def parse_draft_size(text: str) -> DraftShape:
    """A :data:`DRAFT_SIZES` name or ``HIDDENxLAYERS``; ValueError with the allowed forms."""
    if text in DRAFT_SIZES:
        return DRAFT_SIZES[text]
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m.group(1)) < 8 or int(m.group(2)) < 1:
        raise ValueError(f"distill: --draft-config {text!r} is not allowed; allowed: {SIZE_HELP}")
    hidden, layers = int(m.group(1)), int(m.group(2))
    head_dim = 64 if hidden % 64 == 0 else hidden
    heads = hidden // head_dim
    return DraftShape(hidden=hidden, layers=layers, heads=heads,
                      kv_heads=max(1, heads // 2), intermediate=3 * hidden)


def data_stage_problems(o: Any) -> list[tuple[str, Any, bool, str]]:
    """(name, value, ok, allowed) for the settings of the data stage that ``distill`` and
    ``distill-eagle3`` share (the target answering the prompts, rows of ``seq_len``)."""
    return [
        ("temperature", list(o.temperatures),
         bool(o.temperatures) and all(t >= 0 for t in o.temperatures),
         "one or more numbers >= 0"),
        ("max_tokens", o.max_tokens, o.max_tokens >= 1, "an integer >= 1"),
        ("heldout_fraction", o.heldout_fraction, 0 < o.heldout_fraction < 1,
         "a number in (0, 1)"),
        ("seq_len", o.seq_len, o.seq_len >= 8, "an integer >= 8"),
        ("data_shard_prompts", o.data_shard_prompts, o.data_shard_prompts >= 1,
         "an integer >= 1"),
    ]


@dataclass(frozen=True)
class DistillOptions:
    """Every knob of ``distill`` (recorded in work/options.json and REPORT.json)."""

    seed: int = 0
    temperatures: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0)
    max_tokens: int = 128
    chat_template: bool = False
    heldout_fraction: float = 0.1
    seq_len: int = 256
    pretrain_steps: int = 1000
    pretrain_batch: int = 8
    pretrain_lr: float = 3e-3
    finetune_steps: int = 300
    finetune_batch: int = 16
    finetune_lr: float = 1.5e-3
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    min_lr_ratio: float = 0.1
    embed_init: str = "random"
    save_dtype: str = "float32"
    threads: int = 1
    autocast: str = "auto"
    max_position_embeddings: int | None = None
    data_shard_prompts: int = 128
    device: str = "cpu"

    def check(self) -> None:
        """One clear line per bad value, before anything starts."""
        problems = [
            *data_stage_problems(self),
            ("pretrain_steps", self.pretrain_steps, self.pretrain_steps >= 0, "an integer >= 0"),
            ("pretrain_batch", self.pretrain_batch, self.pretrain_batch >= 1, "an integer >= 1"),
            ("pretrain_lr", self.pretrain_lr, self.pretrain_lr > 0, "a number > 0"),
            ("finetune_steps", self.finetune_steps, self.finetune_steps >= 0, "an integer >= 0"),
            ("finetune_batch", self.finetune_batch, self.finetune_batch >= 1, "an integer >= 1"),
            ("finetune_lr", self.finetune_lr, self.finetune_lr > 0, "a number > 0"),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0, "a number >= 0"),
            ("grad_clip", self.grad_clip, self.grad_clip > 0, "a number > 0"),
            ("min_lr_ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1,
             "a number in [0, 1]"),
            ("embed_init", self.embed_init, self.embed_init in EMBED_INITS,
             " or ".join(EMBED_INITS)),
            ("save_dtype", self.save_dtype, self.save_dtype in SAVE_DTYPES,
             " or ".join(SAVE_DTYPES)),
            ("threads", self.threads, self.threads >= 1, "an integer >= 1"),
            ("autocast", self.autocast, self.autocast in AUTOCAST_MODES,
             " or ".join(AUTOCAST_MODES)),
            ("max_position_embeddings", self.max_position_embeddings,
             self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_len,
             "an integer >= seq_len"),
            ("device", self.device, self.device in DEVICES, " or ".join(DEVICES)),
        ]
        for name, value, ok, allowed in problems:
            if not ok:
                raise ValueError(f"distill: {name}={value!r} is not allowed; allowed: {allowed}")

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


# --------------------------------------------------------------------------------------------
# Small helpers.
# --------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_work_dir(out_dir: Path) -> Path:
    """``<out>.work`` beside the output, so the output stays a clean model directory."""
    out_dir = Path(out_dir)
    return out_dir.parent / f"{out_dir.name}.work"


def _write_json(path: Path, data: Any) -> None:
    # Written to a temporary name and renamed: a run killed mid-write leaves no marker that
    # looks finished.
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_config(path: Path) -> dict[str, Any]:
    cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return cfg.get("text_config", cfg)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def split_prompts(n: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) prompt indices, each in file order: a seeded choice, at least one
    held-out prompt and, when n >= 2, at least one training prompt."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = max(1, min(n - 1, round(heldout_fraction * n))) if n >= 2 else n
    held = sorted(perm[:n_held])
    return sorted(perm[n_held:]), held


# --------------------------------------------------------------------------------------------
# Models.
# --------------------------------------------------------------------------------------------


def draft_config(target_dir: Path, shape: DraftShape, options: DistillOptions) -> Any:
    """A LlamaConfig for a drafter of ``shape`` that shares the target's vocabulary, special
    token ids and rotary base, with tied input/output embeddings (the embedding table is most
    of a small drafter; tying halves it)."""
    from transformers import LlamaConfig

    t = _read_config(target_dir)
    max_pos = options.max_position_embeddings or int(t.get("max_position_embeddings", 2048))
    rope_theta = t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 1e4)
    return LlamaConfig(
        vocab_size=int(t["vocab_size"]),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta),
        tie_word_embeddings=True,
        bos_token_id=t.get("bos_token_id"),
        eos_token_id=t.get("eos_token_id"),
        pad_token_id=t.get("pad_token_id"),
        initializer_range=0.02,
    )


def load_causal_lm(path: str | os.PathLike) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    return model.eval()


def target_embedding_projection(target_dir: Path, hidden: int, std: float) -> torch.Tensor:
    """The target's input embedding projected on its top ``hidden`` principal directions,
    rescaled to a per-entry spread ``std`` (the draft's initializer range: the target's own
    scale, tied to an output layer, starts with logits so large that the first steps only
    undo them): tokens the target treats alike start alike, which a from-scratch embedding
    of a large vocabulary needs many steps to learn."""
    from safetensors import safe_open

    emb = None
    for file in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.endswith("embed_tokens.weight"):
                    emb = f.get_tensor(key).float()
                    break
        if emb is not None:
            break
    if emb is None:
        raise ValueError(f"distill: --embed-init target: no embed_tokens.weight in {target_dir}")
    if hidden > emb.shape[1]:
        raise ValueError(f"distill: --embed-init target: draft width {hidden} exceeds the "
                         f"target's embedding width {emb.shape[1]}")
    centered = emb - emb.mean(dim=0, keepdim=True)
    # Eigenvectors of the (width x width) covariance: exact and cheap next to an SVD of V rows.
    _, vecs = torch.linalg.eigh(centered.double().T @ centered.double())
    proj = (centered.double() @ vecs[:, -hidden:].flip(1)).float()
    return proj * (std / proj.std().clamp_min(1e-12))


def new_draft(target_dir: Path, shape: DraftShape, options: DistillOptions) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(options.seed)
    model = LlamaForCausalLM(draft_config(target_dir, shape, options)).float()
    model.set_attn_implementation("sdpa")
    if options.embed_init == "target":
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(
                target_embedding_projection(target_dir, shape.hidden,
                                            model.config.initializer_range))
    return model


def save_draft(model: nn.Module, out_dir: Path, target_dir: Path, save_dtype: str) -> None:
    """The drafter as a self-contained Hugging Face directory (weights in ``save_dtype``)."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.safetensors*"):
        stale.unlink()
    dtype = getattr(torch, save_dtype)
    original = next(model.parameters()).dtype
    model.to(dtype)
    try:
        model.config.dtype = save_dtype
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        model.to(original)
    cfg = model.config
    # Token ids only, no sampling defaults: vLLM applies generation_config.json defaults to
    # requests, and a drafter must not bring its own.
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).is_file():
            shutil.copy2(Path(target_dir) / name, out_dir / name)


# --------------------------------------------------------------------------------------------
# Training tensors.
# --------------------------------------------------------------------------------------------


def corpus_files(corpus: Path | list[Path]) -> list[Path]:
    """Text files of a corpus (one path or several, in the given order): a file itself, or
    every file under a directory with a :data:`CORPUS_SUFFIXES` suffix, sorted by path."""
    files: list[Path] = []
    for path in [corpus] if isinstance(corpus, (str, Path)) else corpus:
        path = Path(path)
        if path.is_file():
            files.append(path)
        else:
            files += sorted(p for p in path.rglob("*")
                            if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES)
    return files


def corpus_stream(files: list[Path], tokenizer: Any, bos_id: int, eos_id: int) -> torch.Tensor:
    """One token stream: bos + tokens + eos per file, files in the given order."""
    from transformers.utils import logging as hf_logging

    # Whole files are longer than the model's context on purpose (windows are cut later);
    # the tokenizer's warning about that would only confuse.
    hf_logging.set_verbosity_error()
    ids: list[int] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a file in another encoding: not worth a special case
        if not text.strip():
            continue
        ids.append(bos_id)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def stream_windows(stream: torch.Tensor, seq_len: int, count: int, seed: int,
                   bos_id: int) -> torch.Tensor:
    """``count`` windows ``bos + seq_len - 1`` tokens from seeded random offsets.

    bos opens every window, not just every file: prompts at inference always start with
    bos and then continue mid-text, so bos has to mean "start of context"."""
    body = seq_len - 1
    if stream.numel() <= body:
        raise ValueError(f"distill: corpus has {stream.numel()} tokens, fewer than one window "
                         f"of {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - body, (count,), generator=gen)
    out = torch.empty((count, seq_len), dtype=torch.int32)
    out[:, 0] = bos_id
    for row, s in enumerate(starts.tolist()):
        out[row, 1:] = stream[s:s + body]
    return out


def response_tensors(responses: list[Response], seq_len: int,
                     pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` [N, L] int32, right-padded: labels are the response tokens
    (the prompt is context only, -100) and each row is cut to ``seq_len`` tokens, keeping the
    end of a long prompt rather than dropping the response."""
    rows = []
    for r in responses:
        if not r.response_ids:
            continue
        prompt = r.prompt_ids[-max(1, seq_len // 2):] if len(r.prompt_ids) > seq_len // 2 \
            else r.prompt_ids
        ids = (prompt + r.response_ids)[:seq_len]
        labels = ([-100] * len(prompt) + r.response_ids)[:seq_len]
        rows.append((ids, labels))
    if not rows:
        raise ValueError("distill: the target produced no tokens to train on")
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int32)
    labels = torch.full((len(rows), width), -100, dtype=torch.int32)
    for b, (ids, lab) in enumerate(rows):
        input_ids[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        labels[b, :len(lab)] = torch.tensor(lab, dtype=torch.int32)
    return input_ids, labels


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross-entropy; columns past the batch's last label are cut first (rows are
    right-padded, so they cost compute and carry no loss)."""
    ids, labels = batch[0].long(), batch[-1].long()
    used = (labels != -100).any(dim=0).nonzero()
    width = int(used.max()) + 1 if used.numel() else ids.shape[1]
    return model(input_ids=ids[:, :width], labels=labels[:, :width]).loss


def train_lm(model: nn.Module, tensors: tuple[torch.Tensor, ...], *, steps: int, batch: int,
             lr: float, seed: int, options: DistillOptions, desc: str, progress: bool,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Language-model training through the shared :func:`~vllm_specx.training.loop.
    train_loop` (AdamW 0.9/0.95, warm-up, cosine to ``min_lr_ratio``, clipping, no weight
    decay on norm gains); ``tensors`` end with the labels."""
    from vllm_specx.training.loop import train_loop

    n = int(tensors[0].shape[0])
    t0 = time.time()
    device = resolve_device(options.device)
    model.to(device)
    history = train_loop(
        model, tensors, lm_loss,
        epochs=math.ceil(steps * batch / n), max_steps=steps, batch_size=batch, lr=lr,
        seed=seed, weight_decay=options.weight_decay, betas=(0.9, 0.95),
        grad_clip=options.grad_clip, min_lr_ratio=options.min_lr_ratio, decay_1d=False,
        autocast_bf16=autocast_on_device(options.autocast, device), desc=desc,
        progress=progress, log=log, device=device,
    )
    model.to("cpu")  # saved and reported from the CPU, whatever trained it
    return {
        "steps": steps, "batch": batch, "peak_lr": lr, "rows": n,
        "supervised_tokens_per_epoch": int((tensors[-1] != -100).sum()),
        # Rows end at their last label; the mean length times rows trained is the work done.
        "positions_trained": int(steps * batch * _mean_row_length(tensors[-1])),
        "final_train_loss": round(history[-1]["train_loss"], 4),
        "seconds": round(time.time() - t0, 1),
    }


def _mean_row_length(labels: torch.Tensor) -> float:
    """Mean number of positions per row up to and including its last label."""
    has = labels != -100
    last = torch.where(has.any(dim=1),
                       labels.shape[1] - has.flip(1).int().argmax(dim=1),
                       torch.zeros(labels.shape[0], dtype=torch.long))
    return float(last.float().mean())


def _autocast_on(options: DistillOptions) -> bool:
    if options.autocast == "auto":
        # AMX or AVX512-BF16: without them bf16 autocast is emulated and slower.
        from vllm_specx.cpu_host import native_bf16

        return native_bf16()
    return options.autocast == "bf16"


def resolve_device(name: str) -> str:
    """``cpu``, ``cuda`` or ``auto`` (cuda where torch sees a CUDA device, else cpu) as the
    torch device the training and feature stages run on; ValueError with one line when
    CUDA is asked for and absent, so a run refuses before anything starts."""
    if name not in DEVICES:
        raise ValueError(f"--device {name!r} is not allowed; allowed: {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ValueError("--device cuda: torch sees no CUDA device on this machine "
                         f"(torch {torch.__version__}); allowed here: cpu or auto")
    return "cuda" if name == "cuda" or (name == "auto" and cuda) else "cpu"


def autocast_on_device(autocast: str, device: str) -> bool:
    """Whether the forward runs under bf16 autocast on ``device``: ``auto`` is on for CUDA
    (every GPU this targets computes bf16 natively) and, on a CPU, where it has native
    bf16 (:func:`_autocast_on`)."""
    if device == "cuda":
        return autocast != "off"
    return _autocast_on(DistillOptions(autocast=autocast))


# --------------------------------------------------------------------------------------------
# Held-out report.
# --------------------------------------------------------------------------------------------


def block_efficiency(matches: list[bool], k: int) -> float:
    """Tokens per target forward of greedy speculative decoding with ``k`` drafts per round,
    given whether the draft's greedy token equals the target's at each position of the
    target's greedy continuation (along an accepted prefix the draft sees exactly that
    prefix, so the teacher-forced matches decide every round)."""
    t, rounds = 0, 0
    while t < len(matches):
        a = 0
        while a < k and t + a < len(matches) and matches[t + a]:
            a += 1
        t += a + 1  # the accepted drafts plus the target's own token
        rounds += 1
    return len(matches) / max(1, rounds)


@torch.no_grad()
def heldout_metrics(target: nn.Module, draft: nn.Module, responses: list[Response], *,
                    batch_size: int = 8, pad_id: int = 0,
                    progress: bool = True) -> dict[str, Any]:
    """Teacher-forced comparison of ``draft`` with ``target`` on held-out responses (see the
    module doc, stage ``report``)."""
    from tqdm.auto import tqdm

    from vllm_specx.training.head import pad_sequences

    greedy_matches: list[list[bool]] = []
    agree = positions = 0
    accept_sum = {}  # temperature -> (sum of sum_x min(p, q), positions)
    nll, nll_count = 0.0, 0
    usable = [r for r in responses if r.response_ids]
    bar = tqdm(total=len(usable), desc="report", disable=not progress, unit="resp")
    for start in range(0, len(usable), batch_size):
        chunk = usable[start:start + batch_size]
        ids, mask = pad_sequences([r.prompt_ids + r.response_ids for r in chunk], pad_id)
        p_logits = target(input_ids=ids, attention_mask=mask).logits.float()
        q_logits = draft(input_ids=ids, attention_mask=mask).logits.float()
        for b, r in enumerate(chunk):
            n_p, n_r = len(r.prompt_ids), len(r.response_ids)
            sl = slice(n_p - 1, n_p - 1 + n_r)  # positions that predict the response
            p_l, q_l = p_logits[b, sl], q_logits[b, sl]
            match = (p_l.argmax(-1) == q_l.argmax(-1))
            agree += int(match.sum())
            positions += n_r
            if r.temperature == 0.0:
                greedy_matches.append(match.tolist())
            p, q = torch.softmax(p_l, -1), torch.softmax(q_l, -1)
            s, c = accept_sum.get(r.temperature, (0.0, 0))
            accept_sum[r.temperature] = (s + float(torch.minimum(p, q).sum()), c + n_r)
            target_ids = torch.tensor(r.response_ids)
            nll += float(torch.nn.functional.cross_entropy(q_l, target_ids, reduction="sum"))
            nll_count += n_r
        bar.update(len(chunk))
    bar.close()
    greedy_positions = sum(len(m) for m in greedy_matches)
    all_accept = sum(s for s, _ in accept_sum.values()) / max(1, positions)
    return {
        "responses": len(usable),
        "positions": positions,
        "greedy_agreement": round(agree / max(1, positions), 4),
        "greedy_agreement_on_greedy_continuations": round(
            sum(sum(m) for m in greedy_matches) / max(1, greedy_positions), 4),
        "greedy_block_efficiency": {
            f"k={k}": round(sum(block_efficiency(m, k) * len(m) for m in greedy_matches)
                            / max(1, greedy_positions), 4)
            for k in (1, 2, 4, 8)
        },
        "expected_acceptance_t1": round(all_accept, 4),
        "expected_acceptance_t1_by_response_temperature": {
            str(t): round(s / max(1, c), 4) for t, (s, c) in sorted(accept_sum.items())},
        "draft_perplexity_on_target_text": round(math.exp(nll / max(1, nll_count)), 3),
    }


# --------------------------------------------------------------------------------------------
# The pipeline.
# --------------------------------------------------------------------------------------------


@dataclass
class DistillJob:
    """What one ``distill`` run is asked to do (the inputs besides the options)."""

    target: Path
    prompts: Path
    out_dir: Path
    init: Path | None = None
    shape: DraftShape | None = None
    corpus: list[Path] | None = None  # files or directories, in order
    work_dir: Path | None = None
    max_prompts: int | None = None
    engine_args: dict[str, Any] | None = None
    command: str = ""
    heldout_prompts: Path | None = None  # held-out prompts of their own, not a split

    @property
    def work(self) -> Path:
        return Path(self.work_dir) if self.work_dir else default_work_dir(self.out_dir)


def stage_inputs(job: DistillJob, options: DistillOptions) -> dict[str, dict[str, Any]]:
    """Per stage, everything its output depends on (including the stages it reads). A stage
    is done when its marker records exactly these inputs; a stage whose inputs changed runs
    again (and so do the stages after it), so one work directory can try several training
    recipes on the same generated data."""
    from vllm_specx.training.data import model_summary, sha256_of_files

    o = options
    data = {
        "target": model_summary(job.target).get("weights_sha256"),
        "prompts_sha256": sha256_of_files([job.prompts]), "max_prompts": job.max_prompts,
        "seed": o.seed, "temperatures": list(o.temperatures), "max_tokens": o.max_tokens,
        "chat_template": o.chat_template, "heldout_fraction": o.heldout_fraction,
        "train_prompts_answered": o.finetune_steps > 0,
    }
    if job.heldout_prompts is not None:
        # Only when given, so the work directories of earlier runs stay valid.
        data["heldout_prompts_sha256"] = sha256_of_files([job.heldout_prompts])
    start = {
        "target": data["target"], "seed": o.seed,
        "init": model_summary(job.init).get("weights_sha256") if job.init else None,
        "shape": dataclasses.asdict(job.shape) if job.shape else None,
        "embed_init": o.embed_init, "max_position_embeddings": o.max_position_embeddings,
    }
    common = {"seq_len": o.seq_len, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
              "min_lr_ratio": o.min_lr_ratio, "threads": o.threads, "autocast": o.autocast}
    pretrain = {
        **start, **common,
        "corpus": [str(c) for c in job.corpus] if job.corpus else None,
        "corpus_files": _corpus_digest(job.corpus) if job.corpus else None,
        "steps": o.pretrain_steps if job.corpus else 0, "batch": o.pretrain_batch,
        "lr": o.pretrain_lr,
    }
    finetune = {
        "data": data, "pretrain": pretrain if pretrain["steps"] else None, **start, **common,
        "steps": o.finetune_steps, "batch": o.finetune_batch, "lr": o.finetune_lr,
        "save_dtype": o.save_dtype, "output": str(job.out_dir),
    }
    return {"data": data, "pretrain": pretrain, "finetune": finetune,
            "report": {"finetune": finetune}}


def _corpus_digest(corpus: list[Path]) -> str:
    """A digest of the corpus file list with sizes and modification times (cheap; a
    changed file means new windows)."""
    import hashlib

    digest = hashlib.sha256()
    for f in corpus_files(corpus):
        st = f.stat()
        digest.update(f"{f}:{st.st_size}:{int(st.st_mtime)}\n".encode())
    return digest.hexdigest()


def _stage_done(marker: Path, inputs: dict[str, Any] | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The marker's record if the stage finished with these ``inputs`` (any, when None)."""
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text(encoding="utf-8"))
    if inputs is not None and info.get("inputs") != inputs:
        if log is not None:
            old = info.get("inputs") or {}
            changed = sorted(k for k in set(old) | set(inputs) if old.get(k) != inputs.get(k))
            log(f"distill: {marker.name}: inputs changed ({', '.join(changed)}): running the "
                "stage again")
        return None
    return info


@dataclass
class DistillRun:
    """One ``distill`` run in progress: what every stage reads (the job, the options, the
    work and output directories, the target's tokenizer ids) and the completion markers.
    Built by :meth:`start`; each stage function takes it and returns its record."""

    job: DistillJob
    options: DistillOptions
    inputs: dict[str, dict[str, Any]]  # per stage, what its output depends on
    markers: dict[str, Path]  # per stage, its completion marker
    tokenizer: Any
    bos_id: int
    eos_id: int
    pad_id: int
    progress: bool = True
    log: Callable[[str], None] = _log
    t_start: float = dataclasses.field(default_factory=time.time)
    _data: dict[str, list[Response]] | None = None
    # Called after each data shard (index, whether generated now); tests stop a run here.
    on_shard: Callable[[int, bool], None] | None = None

    @classmethod
    def start(cls, job: DistillJob, options: DistillOptions, *, progress: bool = True,
              log: Callable[[str], None] = _log) -> DistillRun:
        t_start = time.time()
        torch.set_num_threads(options.threads)  # before the engine: vLLM pins it afterwards
        work, out = job.work, Path(job.out_dir)
        work.mkdir(parents=True, exist_ok=True)
        markers = {s: work / f"{s}.done.json" for s in STAGES[:3]}
        markers["report"] = out / "REPORT.json"
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tok = AutoTokenizer.from_pretrained(str(job.target))
        tcfg = _read_config(job.target)
        eos_id = tcfg.get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        bos_id = tcfg.get("bos_token_id")
        bos_id = bos_id if bos_id is not None else (tok.bos_token_id if tok.bos_token_id
                                                      is not None else eos_id)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos_id or 0)
        return cls(job, options, stage_inputs(job, options), markers, tok, bos_id, eos_id,
                   pad_id, progress, log, t_start)

    @property
    def out(self) -> Path:
        return Path(self.job.out_dir)

    @property
    def pretrain_dir(self) -> Path:
        return self.job.work / "pretrain"

    @property
    def data_file(self) -> Path:
        return self.job.work / "data.pt"

    def runs(self, stage: str) -> bool:
        """Whether the stage is part of this run at all (pretraining needs a corpus)."""
        return stage != "pretrain" or self.inputs["pretrain"]["steps"] > 0

    def done(self, stage: str) -> dict[str, Any] | None:
        """The stage's record when it finished before with the same inputs, else None."""
        if stage == "data" and not self.inputs["data"]["train_prompts_answered"]:
            # A raw-text-only run needs only the held-out answers: data that answered the
            # training prompts too holds exactly those (held-out requests come first, with
            # the same seeds), so a copy of a distilled run's data serves its baseline.
            superset = {**self.inputs["data"], "train_prompts_answered": True}
            if _stage_done(self.markers["data"], superset) is not None:
                return _stage_done(self.markers["data"])
        info = _stage_done(self.markers[stage], self.inputs[stage], self.log)
        if stage == "finetune" and info is not None and not (self.out / "config.json").is_file():
            return None  # the output directory was removed since: save it again
        return info

    def finish(self, stage: str, info: dict[str, Any]) -> None:
        _write_json(self.markers[stage], {**info, "inputs": self.inputs[stage]})

    def responses(self, split: str) -> list[Response]:
        """The data stage's ``"train"`` or ``"heldout"`` responses (read once)."""
        if self._data is None:
            data = torch.load(self.data_file)
            self._data = {k: [Response(**r) for r in data[k]] for k in ("train", "heldout")}
        return self._data[split]


def run_pretrain(run: DistillRun) -> dict[str, Any]:
    """Stage ``pretrain``: language-model training on corpus windows; the model is kept
    (float32) in the work directory for the next stage."""
    options, job = run.options, run.job
    t0 = time.time()
    assert job.corpus is not None
    files = corpus_files(job.corpus)
    stream = corpus_stream(files, run.tokenizer, run.bos_id, run.eos_id)
    windows = stream_windows(stream, options.seq_len,
                             options.pretrain_steps * options.pretrain_batch,
                             options.seed + 1, run.bos_id)
    model = _start_model(job, options)
    run.log(f"distill: pretrain: {param_count(model):,} parameters on {len(files)} corpus "
            f"files, {stream.numel():,} tokens")
    info = train_lm(model, (windows, windows), steps=options.pretrain_steps,
                    batch=options.pretrain_batch, lr=options.pretrain_lr,
                    seed=options.seed + 2, options=options, desc="pretrain",
                    progress=run.progress, log=run.log)
    info.update(corpus_files=len(files), corpus_tokens=int(stream.numel()),
                seconds=round(time.time() - t0, 1))
    # Kept in float32: the next stage continues from it.
    save_draft(model, run.pretrain_dir, job.target, "float32")
    return info


def run_data(run: DistillRun) -> dict[str, Any]:
    """Stage ``data``: the target answers the prompts in vLLM at every temperature."""
    from vllm_specx.training.data import generate_responses, read_prompt_file

    options, job = run.options, run.job
    t0 = time.time()
    prompts = read_prompt_file(job.prompts)
    if job.max_prompts is not None:
        prompts = prompts[:job.max_prompts]
    if job.heldout_prompts is not None:
        # A held-out file of its own: every --prompts prompt trains, the file's are held
        # out, and a prompt in both would make the report measure training data.
        held_prompts = read_prompt_file(job.heldout_prompts)
        both = set(held_prompts) & set(prompts)
        if both:
            raise ValueError(f"distill: --heldout-prompts {job.heldout_prompts}: {len(both)} "
                             f"of its prompts are also in --prompts {job.prompts}; allowed: "
                             "held-out prompts that are not training prompts")
        prompts = held_prompts + prompts
        held_idx, train_idx = list(range(len(held_prompts))), list(range(
            len(held_prompts), len(prompts)))
    else:
        train_idx, held_idx = split_prompts(len(prompts), options.heldout_fraction,
                                            options.seed)
    if options.chat_template:
        prompts = [run.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
        ) for p in prompts]
    if options.finetune_steps == 0:
        train_idx = []  # a raw-text-only drafter needs only the held-out answers
    # Held-out prompts first: their requests get the same seeds whether or not the
    # training prompts are answered too, so a distilled drafter and its raw-text-only
    # baseline are reported on identical held-out responses.
    order = held_idx + train_idx
    run.log(f"distill: data: {len(order)} prompts ({len(held_idx)} held out) x temperatures "
            f"{list(options.temperatures)}, max_tokens {options.max_tokens}, "
            f"target {job.target}")
    # Shards of the requests in the work directory: a killed data stage resumes from its
    # last complete shard (the key: everything the responses depend on).
    shard_key = json.dumps({**run.inputs["data"], "order": order,
                            "shard_prompts": options.data_shard_prompts}, sort_keys=True)

    def shard_done(k: int, generated: bool) -> None:
        if generated:
            run.log(f"distill: data: shard {k} written")

    responses = generate_responses(
        job.target, [prompts[i] for i in order], temperatures=list(options.temperatures),
        max_tokens=options.max_tokens, seed=options.seed,
        engine_args={"torch_threads": options.threads, **(job.engine_args or {})},
        shard_dir=run.job.work / "data_shards", shard_prompts=options.data_shard_prompts,
        shard_key=shard_key, on_shard=run.on_shard or shard_done,
    )
    n_held = len(held_idx) * len(options.temperatures)
    as_rows = [dataclasses.asdict(r) for r in responses]
    torch.save({"train": as_rows[n_held:], "heldout": as_rows[:n_held]}, run.data_file)
    run._data = None
    info = {
        "seconds": round(time.time() - t0, 1),
        "prompts": len(prompts), "train_prompts": len(train_idx),
        "heldout_prompts": len(held_idx), "responses": len(responses),
        "train_tokens": sum(len(r.response_ids) for r in responses[n_held:]),
        "heldout_tokens": sum(len(r.response_ids) for r in responses[:n_held]),
    }
    run.log(f"distill: data: {json.dumps(info)}")
    return info


def run_finetune(run: DistillRun) -> dict[str, Any]:
    """Stage ``finetune``: training on the target's answers to the training prompts, from
    the pretrained model (or the start model); the drafter is saved to the output."""
    options, job = run.options, run.job
    t0 = time.time()
    model = (load_causal_lm(run.pretrain_dir) if run.runs("pretrain")
             else _start_model(job, options))
    if options.finetune_steps > 0:
        ids, labels = response_tensors(run.responses("train"), options.seq_len, run.pad_id)
        info = train_lm(model, (ids, labels), steps=options.finetune_steps,
                        batch=options.finetune_batch, lr=options.finetune_lr,
                        seed=options.seed + 3, options=options, desc="finetune",
                        progress=run.progress, log=run.log)
    else:
        info = {"steps": 0}
    save_draft(model, run.out, job.target, options.save_dtype)
    info["seconds"] = round(time.time() - t0, 1)
    run.log(f"distill: drafter written to {run.out}")
    return info


def run_report(run: DistillRun) -> dict[str, Any]:
    """Stage ``report``: the saved drafter, reloaded as a user would, measured on the
    held-out responses; REPORT.json's content."""
    from vllm_specx.training.data import model_summary

    options, job, out = run.options, run.job, run.out
    t0 = time.time()
    target_model = load_causal_lm(job.target)
    draft_model = load_causal_lm(out)
    heldout = heldout_metrics(target_model, draft_model, run.responses("heldout"),
                              pad_id=run.pad_id, progress=run.progress)
    del target_model
    weights = sorted(out.glob("*.safetensors"))
    stages = {s: _stage_done(run.markers[s]) for s in STAGES[:3]}
    for record in stages.values():
        if record:
            record.pop("inputs", None)
    if not run.runs("pretrain"):
        stages["pretrain"] = None
    report = {
        "description": "drafter trained by vllm-specx distill (Yi et al., 'Towards Fast "
        "Multilingual LLM Inference: Speculative Decoding and Specialized Drafters': "
        "self-distillation from the target at several temperatures, optional raw-text "
        "pretraining)",
        "command": job.command,
        "target": model_summary(job.target),
        "draft": {
            **model_summary(out),
            "params": param_count(draft_model),
            "shape": dataclasses.asdict(job.shape) if job.shape else None,
            "init": str(job.init) if job.init else None,
            "saved_dtype": options.save_dtype,
            "safetensors_bytes": sum(f.stat().st_size for f in weights),
            "dir_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
        },
        "options": options.to_json(),
        "stages": stages,
        "training_seconds": round(sum((stages[s] or {}).get("seconds", 0.0)
                                      for s in ("pretrain", "finetune")), 1),
        "heldout": heldout,
        "heldout_definition": (
            "held-out prompts (a seeded fraction, never trained on) answered by the target in "
            "vLLM at every temperature; the draft and target teacher-forced on those answers in "
            "transformers. greedy_agreement: draft argmax == target argmax over all positions; "
            "greedy_block_efficiency: tokens per target forward of greedy speculation with k "
            "drafts, on the temperature-0 answers; expected_acceptance_t1: mean sum_x min(p, q) "
            "(standard speculative sampling at temperature 1)"),
        "versions": _versions(options),
        "report_seconds": round(time.time() - t0, 1),
        "total_seconds_this_run": round(time.time() - run.t_start, 1),
    }
    # The paths of this machine stay out of a report meant to be committed.
    for section in ("target", "draft"):
        report[section].pop("path", None)
    run.log(f"distill: held-out {json.dumps(heldout)}")
    return report


# Stage -> the function that runs it, in STAGES order.
STAGE_RUNNERS: dict[str, Callable[[DistillRun], dict[str, Any]]] = {
    "pretrain": run_pretrain, "data": run_data, "finetune": run_finetune, "report": run_report,
}


def _skip_note(stage: str, record: dict[str, Any], run: DistillRun) -> str:
    """What a finished stage's record says, for the "done before" line."""
    if stage == "data":
        return f"{record['responses']} responses"
    if stage == "report":
        return str(run.markers["report"])
    return f"{record.get('steps', 0)} steps"


def resume_stages(run: DistillRun, stop_after: str | None = None,
                  runners: dict[str, Callable[[DistillRun], dict[str, Any]]] | None = None,
                  ) -> dict[str, Any]:
    """The resume driver: each stage of the run, in order, is skipped when its marker
    records the same inputs, else run and marked done. Returns the last stage's record
    (``stop_after``'s, or the report; ``{}`` when ``stop_after`` names a stage this run
    skips)."""
    runners = STAGE_RUNNERS if runners is None else runners
    record: dict[str, Any] = {}
    for stage in STAGES:
        record = {}
        if run.runs(stage):
            done = run.done(stage)
            if done is not None:
                run.log(f"distill: stage {stage} done before ({_skip_note(stage, done, run)}), "
                        "skipped")
                record = done
            else:
                record = runners[stage](run)
                run.finish(stage, record)
        if stage == stop_after:
            break
    return record


def distill(job: DistillJob, options: DistillOptions = DistillOptions(), *,
            progress: bool = True, log: Callable[[str], None] = _log,
            stop_after: str | None = None) -> dict[str, Any]:
    """Run (or resume) the pipeline of the module doc; returns the REPORT.json content (or,
    with ``stop_after``, the record of that stage)."""
    options.check()
    run = DistillRun.start(job, options, progress=progress, log=log)
    return resume_stages(run, stop_after)


def _start_model(job: DistillJob, options: DistillOptions) -> nn.Module:
    if job.init is not None:
        return load_causal_lm(job.init)
    assert job.shape is not None
    return new_draft(job.target, job.shape, options)


def _versions(options: DistillOptions) -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "platform": platform.platform(),
        "torch_threads": options.threads, "autocast_bf16": _autocast_on(options),
    }
