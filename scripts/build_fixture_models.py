#!/usr/bin/env python3
"""Build the small target/draft model pair that vllm-specx uses as a realistic fixture.

Random-weight models never agree with each other, so speculative decoding measured on them
says nothing. No model hub is reachable from CI, so this script trains a tiny but real pair
from text that every Python install carries: the standard library's own source files (code,
comments, docstrings), read at build time from ``sysconfig.get_paths()["stdlib"]``.

Pipeline (each step is a ``--stage``; later stages read what earlier ones left behind):

``tokenizer``
    List the stdlib ``*.py`` files (sorted; tests, codec tables and generated files left out),
    split them into train and held-out by a hash of the relative path (about 1 in 20 held out),
    train a byte-level BPE tokenizer (``tokenizers``) on the train files, tokenize both splits
    into the work dir, and write ``heldout_prompts.jsonl`` (short snippets starting at a
    ``def``/``class`` line of held-out files, so later users do not depend on their own Python).
``target``
    Train ``LlamaForCausalLM`` (4 layers, hidden 256, GQA 4/2 heads of 64) from scratch on
    random 256-token windows of the train stream, with ``vllm-specx distill``'s window sampler
    and training loop (``vllm_specx.training``: one training code path for every model).
``distill``
    ``vllm-specx distill --stop-after data`` (the command users run) up to its data stage:
    pretrain a 2-layer, hidden-128 Llama draft (size ``small``) on the train files (linked
    into the work dir as its ``--corpus``), then self-distillation data as in Yi et al.'s
    specialized-drafter recipe, in miniature: the target answers snippets of TRAIN files
    (stdlib references in the work dir, chosen like the head's) in vLLM at temperatures 0,
    0.3, 0.7 and 1.0 (pure temperature sampling, no top-k/top-p).
``draft``
    The rest of the same ``vllm-specx distill`` command (its finished stages are skipped):
    finetune the pretrained draft on the target's answers (loss on the generated tokens
    only), write ``draft/`` and distill's held-out report, which lands in ``REPORT.json``
    (``stages.draft.distill_heldout``).
``head``
    Train the SpecDec++ acceptance head for the pair with ``vllm-specx train-head`` (the same
    command users run): training prompts are snippets of TRAIN files chosen the way the
    held-out prompts are (so none overlaps ``heldout_prompts.jsonl``), stored as stdlib
    references in ``head/train_prompts.jsonl``; the target answers them in vLLM at
    temperatures 0 and 1. Writes ``head/`` (config.json with the held-out loss and AUC,
    model.safetensors, metrics.json) and the head's numbers into ``REPORT.json``. Rebuild only
    the head with ``--stage head`` (9-15 minutes, mostly the target's generation in vLLM).
    ``--quick`` skips this stage unless ``--stage head`` names it.
``report``
    Reload both saved directories as a user would and write ``REPORT.json``: held-out
    perplexities, greedy per-token agreement of the pair on target greedy continuations of the
    stored held-out prompts (and how it varies across tokens), greedy block efficiency for a
    few draft lengths, parameter counts, sizes, stage times, seeds and versions.

Outputs (``--out``, default ``fixtures/models``): ``target/`` and ``draft/`` (config.json,
generation_config.json, model.safetensors in float32 with tied embeddings, tokenizer.json,
tokenizer_config.json, special_tokens_map.json), ``heldout_prompts.jsonl`` and
``REPORT.json``. Intermediate files (token streams, distilled data, the pretrained draft)
live in ``--work-dir`` (default ``.cache/fixture_build``, git-ignored).

Runtime (measured on the project's 2-core machine shared with other jobs, 1 torch thread, bf16
autocast): 12-25 minutes of wall time for the full build, depending on the load from other
jobs (load average 3-8): tokenizer ~15 s, target 8-16 min, distill + draft 4-6 min (the
draft's training 3-5 min, the target's answers in vLLM ~1 min; measured before both moved
into ``vllm-specx distill``, whose full-size run has not been re-timed), report ~0.5 min;
plus head 9-15 min (9.5 min at load average 20, 13.5 at 12: mostly the
target's generation in vLLM). The last full build's wall time, the load average at its start
and every stage's time are in ``REPORT.json``. One torch thread on purpose: on the shared
machine two OpenMP threads ran 2-3x slower than one. ``--quick`` trains a toy pair for a
few steps (about 1.5 min, most of it starting vLLM for the distillation data) and is meant for
smoke tests into a temporary ``--out``.

Determinism: every random choice comes from a fixed seed (``--seed``, default 1234): file split
and snippet choice hash the relative path, batches and sampling use seeded
``torch.Generator`` objects. Re-running on the same machine, torch version, thread count and
Python stdlib gives the same weights; other CPUs may differ in the last bits of float math, and
CPUs without native bf16 train in plain float32 (``--autocast auto``): same recipe, other bits.

Usage::

    .venv/bin/python scripts/build_fixture_models.py                 # everything
    .venv/bin/python scripts/build_fixture_models.py --stage distill --stage draft --stage report
    .venv/bin/python scripts/build_fixture_models.py --quick --out /tmp/fx
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

# The tokenizers library trains with a Rayon pool sized to all cores; the build shares a small
# machine, so cap it before the library is imported.
os.environ.setdefault("RAYON_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tokenizer", "target", "distill", "draft", "head", "report")
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Directory names anywhere in a path that mark test suites; their text is mostly assertions on
# odd inputs and would dominate the corpus.
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
# Top-level entries that are generated tables or data rather than written Python.
EXCLUDED_TOP = {"encodings", "pydoc_data", "__phello__", "turtledemo", "ensurepip"}
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Every knob of a build; written into REPORT.json so a result can be traced to its recipe."""

    seed: int = 1234
    vocab_size: int = 4096
    max_file_bytes: int = 300_000
    heldout_every: int = 20  # a file is held out when hash(relpath) % heldout_every == 0
    max_train_files: int = 0  # 0: all eligible files
    n_prompts: int = 64  # stored held-out prompts
    prompts_per_file: int = 3
    prompt_min_chars: int = 160
    eval_text_chars: int = 1000
    seq_len: int = 256
    max_position_embeddings: int = 1024
    target: ModelShape = ModelShape(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768)
    draft: ModelShape = ModelShape(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=384)
    # Many small steps: this early in training, updates matter more than batch size.
    target_steps: int = 1000
    target_batch: int = 8
    target_lr: float = 3e-3
    draft_pretrain_steps: int = 800
    draft_pretrain_batch: int = 8
    draft_pretrain_lr: float = 3e-3
    distill_prompts: int = 384  # per temperature; the same prompts at every temperature
    distill_new_tokens: int = 96
    distill_temperatures: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0)
    draft_finetune_steps: int = 300
    draft_finetune_batch: int = 32
    draft_finetune_lr: float = 1.5e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    eval_windows: int = 128  # held-out windows of seq_len tokens for the perplexity
    agree_new_tokens: int = 64  # target greedy continuation length per held-out prompt
    # Acceptance head (stage head): prompts from train files, answered at these temperatures.
    head_prompts: int = 384
    head_temperatures: tuple[float, ...] = (0.0, 1.0)
    head_max_tokens: int = 128
    head_epochs: int = 3
    log_every: int = 25
    threads: int = 1
    autocast: str = "auto"  # auto: bf16 where the CPU has native bf16, else off


QUICK = BuildConfig(
    vocab_size=400,
    max_train_files=40,
    heldout_every=10,
    n_prompts=6,
    eval_text_chars=400,
    seq_len=64,
    max_position_embeddings=256,
    target=ModelShape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128),
    draft=ModelShape(hidden=32, layers=1, heads=1, kv_heads=1, intermediate=64),
    target_steps=12,
    target_batch=8,
    draft_pretrain_steps=6,
    draft_pretrain_batch=8,
    distill_prompts=8,
    distill_new_tokens=12,
    draft_finetune_steps=8,
    draft_finetune_batch=8,
    eval_windows=8,
    agree_new_tokens=12,
    log_every=4,
    head_prompts=6,
    head_max_tokens=8,
    head_epochs=1,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 present: without them bf16 autocast is emulated and slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def path_hash(seed: int, rel: str) -> int:
    # A content-free hash of the path, so the split does not move when a Python patch
    # release edits a file, and does not depend on PYTHONHASHSEED.
    return int(hashlib.sha256(f"{seed}:{rel}".encode()).hexdigest()[:12], 16)


# --------------------------------------------------------------------------------------------
# Paths and the REPORT.json read-modify-write (each stage records what it did there).
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Paths:
    out: Path
    work: Path

    @property
    def tokenizer(self) -> Path:
        return self.work / "tokenizer"

    @property
    def target(self) -> Path:
        return self.out / "target"

    @property
    def draft(self) -> Path:
        return self.out / "draft"

    @property
    def report(self) -> Path:
        return self.out / "REPORT.json"

    @property
    def prompts(self) -> Path:
        return self.out / "heldout_prompts.jsonl"

    @property
    def head(self) -> Path:
        return self.out / "head"


def shown(path: Path) -> str:
    # Relative to the working directory when inside it: commands recorded in committed files
    # (the head's config.json, REPORT.json) should not carry this machine's absolute paths.
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def load_report(paths: Paths) -> dict[str, Any]:
    if paths.report.exists():
        return json.loads(paths.report.read_text())
    return {}


def update_report(paths: Paths, key: str, value: Any) -> None:
    report = load_report(paths)
    report.setdefault("stages", {})[key] = value
    paths.out.mkdir(parents=True, exist_ok=True)
    paths.report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# Stage 1: corpus, tokenizer, token streams, held-out prompts.
# --------------------------------------------------------------------------------------------


def list_corpus(cfg: BuildConfig) -> tuple[Path, list[str], list[str]]:
    """Return the stdlib root and the sorted train / held-out relative paths."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    eligible: list[str] = []
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib).as_posix()
        parts = rel.split("/")
        if EXCLUDED_PARTS.intersection(parts[:-1]) or parts[0] in EXCLUDED_TOP:
            continue
        if parts[0].startswith(EXCLUDED_PREFIXES):
            continue
        size = p.stat().st_size
        if size < 200 or size > cfg.max_file_bytes:
            continue
        eligible.append(rel)
    train = [r for r in eligible if path_hash(cfg.seed, r) % cfg.heldout_every != 0]
    heldout = [r for r in eligible if path_hash(cfg.seed, r) % cfg.heldout_every == 0]
    if cfg.max_train_files:
        # An evenly spread subset, not the alphabetical head, so quick runs still see variety.
        step = max(1, len(train) // cfg.max_train_files)
        train = train[::step][: cfg.max_train_files]
        heldout = heldout[: max(cfg.n_prompts, 4)]
    return stdlib, train, heldout


def read_text(stdlib: Path, rel: str) -> str | None:
    try:
        return (stdlib / rel).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # a handful of files declare other encodings; not worth the special case


def make_prompt_records(cfg: BuildConfig, rel: str, text: str) -> list[dict[str, Any]]:
    """Snippets starting at def/class lines: a prompt of whole lines plus a longer text.

    Up to ``prompts_per_file`` per file, in a seeded order, from starts at least
    ``eval_text_chars`` apart so no two snippets share text.
    """
    lines = text.splitlines(keepends=True)
    offsets, pos = [], 0
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    starts = [
        i
        for i, line in enumerate(lines)
        if line.lstrip(" ").startswith(("def ", "class ", "async def "))
        and len(line) - len(line.lstrip(" ")) <= 4
    ]
    random.Random(f"{cfg.seed}:{rel}").shuffle(starts)
    records: list[dict[str, Any]] = []
    chosen: list[int] = []
    for i in starts:
        if len(records) == cfg.prompts_per_file:
            break
        if any(abs(offsets[i] - offsets[c]) < cfg.eval_text_chars for c in chosen):
            continue
        prompt, j = "", i
        while j < len(lines) and len(prompt) < cfg.prompt_min_chars:
            prompt += lines[j]
            j += 1
        body = prompt
        while j < len(lines) and len(body) + len(lines[j]) <= cfg.eval_text_chars:
            body += lines[j]
            j += 1
        if len(prompt) < cfg.prompt_min_chars // 2:
            continue
        chosen.append(i)
        records.append({"source": f"stdlib:{rel}", "line": i + 1, "prompt": prompt, "text": body})
    return records


def build_tokenizer(cfg: BuildConfig, texts: list[str], out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Llama convention: encoding a text starts with bos; vLLM and transformers both honour a
    # post-processor stored in tokenizer.json.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    if tok.get_vocab_size() != cfg.vocab_size:
        # The model configs use cfg.vocab_size; a corpus too small for that many merges would
        # leave embedding rows no token can reach.
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {cfg.vocab_size}")
    tok.save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by save_pretrained: transformers 5 would name its own
    # backend class, which older transformers cannot load. clean_up_tokenization_spaces must be
    # off, or decoding would rewrite code such as "f( x )".
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_docs(tok_dir: Path, texts: list[str]) -> torch.Tensor:
    """One stream: bos + tokens + eos per file, files in sorted order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def stage_tokenizer(cfg: BuildConfig, paths: Paths) -> None:
    t0 = time.time()
    stdlib, train_rel, heldout_rel = list_corpus(cfg)
    train_texts = [t for r in train_rel if (t := read_text(stdlib, r)) is not None]
    heldout_pairs = [(r, t) for r in heldout_rel if (t := read_text(stdlib, r)) is not None]
    log(f"corpus: {stdlib} train files {len(train_texts)}, held-out files {len(heldout_pairs)}")
    corpus_hash = hashlib.sha256()
    for text in train_texts:
        corpus_hash.update(text.encode())
    build_tokenizer(cfg, train_texts, paths.tokenizer)
    train_ids = encode_docs(paths.tokenizer, train_texts)
    heldout_ids = encode_docs(paths.tokenizer, [t for _, t in heldout_pairs])
    paths.work.mkdir(parents=True, exist_ok=True)
    torch.save(train_ids, paths.work / "train_ids.pt")
    torch.save(heldout_ids, paths.work / "heldout_ids.pt")

    # Round-robin over the held-out files (first snippet of every file, then the second...),
    # so that the first n prompts come from n different files.
    per_file = [make_prompt_records(cfg, rel, text) for rel, text in heldout_pairs]
    records = [recs[k] for k in range(cfg.prompts_per_file) for recs in per_file if k < len(recs)][
        : cfg.n_prompts
    ]
    paths.out.mkdir(parents=True, exist_ok=True)
    with open(paths.prompts, "w", encoding="utf-8") as f:
        for i, rec in enumerate(records):
            # The stdlib text itself stays out of the repository: store where it is and a
            # hash; vllm_specx.fixtures reads it back from the local stdlib.
            ref = {
                "id": i,
                "source": rec["source"],
                "line": rec["line"],
                "prompt_chars": len(rec["prompt"]),
                "text_chars": len(rec["text"]),
                "sha256": hashlib.sha256(rec["text"].encode("utf-8")).hexdigest(),
            }
            f.write(json.dumps(ref) + "\n")
    train_chars = sum(len(t) for t in train_texts)
    info = {
        "seconds": round(time.time() - t0, 1),
        "stdlib": str(stdlib),
        "python_version": platform.python_version(),
        "train_files": len(train_texts),
        "heldout_files": len(heldout_pairs),
        "train_chars": train_chars,
        "train_tokens": int(train_ids.numel()),
        "heldout_tokens": int(heldout_ids.numel()),
        "chars_per_token": round(train_chars / max(1, train_ids.numel()), 3),
        "train_corpus_sha256": corpus_hash.hexdigest(),
        "tokenizer_sha256": sha256_file(paths.tokenizer / "tokenizer.json"),
        "heldout_prompts": len(records),
    }
    log(f"tokenizer: {json.dumps(info)}")
    update_report(paths, "tokenizer", info)


# --------------------------------------------------------------------------------------------
# Models and the shared training loop.
# --------------------------------------------------------------------------------------------


def llama_config(cfg: BuildConfig, shape: ModelShape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        # Tied input/output embeddings keep the pair small (the embedding is most of a tiny
        # model); vLLM's Llama honours the flag.
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        initializer_range=0.02,
        torch_dtype="float32",
    )


def new_model(cfg: BuildConfig, shape: ModelShape, seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(cfg, shape))
    model.config._attn_implementation = "sdpa"
    return model.float()


def load_model(path: Path) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def save_model(model: Any, out_dir: Path, tok_dir: Path) -> None:
    from transformers import GenerationConfig

    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Only token ids, no sampling defaults: vLLM applies generation_config.json defaults to
    # every request, and tests must see plain temperature/top-k/top-p behaviour.
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copy2(tok_dir / name, out_dir / name)


def param_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def distill_options(cfg: BuildConfig) -> Any:
    """The training knobs shared by every model of the build, as ``vllm-specx distill``
    takes them (its training code trains the target too: one training code path)."""
    from vllm_specx.training.distill import DistillOptions

    return DistillOptions(
        seed=cfg.seed, weight_decay=cfg.weight_decay, grad_clip=1.0, min_lr_ratio=0.1,
        threads=cfg.threads, autocast=cfg.autocast, seq_len=cfg.seq_len,
    )


# --------------------------------------------------------------------------------------------
# Stage 2: target.
# --------------------------------------------------------------------------------------------


def stage_target(cfg: BuildConfig, paths: Paths) -> None:
    """Pretraining from scratch on random windows of the train stream, through the same
    window sampler and training loop as ``vllm-specx distill``'s pretrain stage."""
    from vllm_specx.training.distill import stream_windows, train_lm

    train_ids = torch.load(paths.work / "train_ids.pt")
    model = new_model(cfg, cfg.target, cfg.seed + 1)
    log(f"target: {param_count(model):,} parameters, {cfg.target}")
    windows = stream_windows(train_ids, cfg.seq_len, cfg.target_steps * cfg.target_batch,
                             cfg.seed + 2, bos_id=0)
    info = train_lm(model, (windows, windows), steps=cfg.target_steps, batch=cfg.target_batch,
                    lr=cfg.target_lr, seed=cfg.seed + 2, options=distill_options(cfg),
                    desc="target", progress=False, log=log)
    save_model(model, paths.target, paths.tokenizer)
    info.update(params=param_count(model), seq_len=cfg.seq_len, autocast=cfg.autocast,
                threads=cfg.threads)
    update_report(paths, "target", info)


# --------------------------------------------------------------------------------------------
# Stage 3: self-distillation data.
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def generate(
    model: Any,
    prompts: torch.Tensor,
    new_tokens: int,
    temperature: float,
    gen: torch.Generator | None,
    eos_id: int = 1,
) -> torch.Tensor:
    """Continue equal-length prompts with a KV cache; temperature 0 is argmax.

    A hand-written loop instead of ``model.generate`` so that nothing (top-k defaults,
    repetition penalties) changes the distribution being distilled. Rows that produced eos are
    padded with eos afterwards; callers mask those positions.
    """
    out = model(input_ids=prompts, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1, :]
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    result = []
    for _ in range(new_tokens):
        if temperature == 0.0:
            nxt = logits.argmax(dim=-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        done |= nxt == eos_id
        result.append(nxt)
        if bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :]
    cont = torch.stack(result, dim=1)
    if cont.shape[1] < new_tokens:
        pad = torch.full((cont.shape[0], new_tokens - cont.shape[1]), eos_id, dtype=cont.dtype)
        cont = torch.cat([cont, pad], dim=1)
    return cont


def distill_prompt_refs(cfg: BuildConfig) -> list[dict[str, Any]]:
    """Distillation prompts: ``cfg.distill_prompts`` snippets of TRAIN files (never a
    held-out file), chosen like the head's, as stdlib references."""
    return head_prompt_refs(cfg, cfg.distill_prompts, "distill-prompts")


def link_corpus(cfg: BuildConfig, corpus: Path) -> int:
    """The train files as a corpus directory for ``distill --corpus``: symbolic links to the
    stdlib files under their relative paths (nothing copied), so distill tokenizes exactly
    the train split, in the same sorted order as the token stream of stage tokenizer."""
    stdlib, train_rel, _ = list_corpus(cfg)
    if corpus.exists():
        shutil.rmtree(corpus)
    count = 0
    for rel in train_rel:
        if read_text(stdlib, rel) is None:
            continue  # the tokenizer stage skips these too
        link = corpus / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(stdlib / rel)
        count += 1
    return count


def distill_argv(cfg: BuildConfig, paths: Paths) -> list[str]:
    """The ``vllm-specx distill`` command line of the draft (stages distill and draft)."""
    from vllm_specx.training.distill import DRAFT_SIZES

    size = next((k for k, v in DRAFT_SIZES.items() if dataclasses.astuple(v) == (
        cfg.draft.hidden, cfg.draft.layers, cfg.draft.heads, cfg.draft.kv_heads,
        cfg.draft.intermediate)), None)
    if size is None:
        raise RuntimeError(f"draft shape {cfg.draft} is not a vllm-specx distill size")
    argv = [
        "distill",
        "--target", shown(paths.target),
        "--draft-config", size,
        "--prompts", shown(paths.work / "distill_prompts.jsonl"),
        "--corpus", shown(paths.work / "corpus"),
        "-o", shown(paths.draft),
        "--work-dir", shown(paths.work / "distill"),
        "--seed", str(cfg.seed),
        "--max-tokens", str(cfg.distill_new_tokens),
        "--seq-len", str(cfg.seq_len),
        "--pretrain-steps", str(cfg.draft_pretrain_steps),
        "--pretrain-batch", str(cfg.draft_pretrain_batch),
        "--pretrain-lr", str(cfg.draft_pretrain_lr),
        "--finetune-steps", str(cfg.draft_finetune_steps),
        "--finetune-batch", str(cfg.draft_finetune_batch),
        "--finetune-lr", str(cfg.draft_finetune_lr),
        "--weight-decay", str(cfg.weight_decay),
        "--max-position-embeddings", str(cfg.max_position_embeddings),
        "--threads", str(cfg.threads),
        "--autocast", cfg.autocast,
        "--no-progress",
    ]
    for t in cfg.distill_temperatures:
        argv += ["--temperature", str(t)]
    if cfg.max_position_embeddings < 512:  # toy models: below the engine's default length
        argv += ["--engine-args", json.dumps({"max_model_len": cfg.max_position_embeddings})]
    return argv


def run_specx(argv: list[str], label: str) -> None:
    from vllm_specx.cli import main as specx_main

    log(f"{label}: vllm-specx {' '.join(argv)}")
    rc = specx_main(argv)
    if rc:
        raise RuntimeError(f"vllm-specx {argv[0]} exited with {rc}")


def stage_distill(cfg: BuildConfig, paths: Paths) -> None:
    """``vllm-specx distill --stop-after data``: the draft's pretraining on the train files,
    then the self-distillation data of Yi et al.'s recipe (the target answers train-file
    snippets in vLLM at temperatures 0, 0.3, 0.7 and 1.0)."""
    t0 = time.time()
    refs = distill_prompt_refs(cfg)
    paths.work.mkdir(parents=True, exist_ok=True)
    (paths.work / "distill_prompts.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in refs), encoding="utf-8")
    files = link_corpus(cfg, paths.work / "corpus")
    run_specx([*distill_argv(cfg, paths), "--stop-after", "data"], "distill")
    data = json.loads((paths.work / "distill" / "data.done.json").read_text())
    data.pop("inputs", None)
    info = {"seconds": round(time.time() - t0, 1), "temperatures": list(cfg.distill_temperatures),
            "new_tokens": cfg.distill_new_tokens, "corpus_files": files, **data}
    log(f"distill: {json.dumps(info)}")
    update_report(paths, "distill", info)


# --------------------------------------------------------------------------------------------
# Stage 4: draft (pretrain on raw text, finetune on the distilled continuations).
# --------------------------------------------------------------------------------------------


def stage_draft(cfg: BuildConfig, paths: Paths) -> None:
    """``vllm-specx distill`` itself (the pretrained draft and the data of stage distill are
    reused when their inputs did not change): finetune on the target's answers, write
    ``draft/`` and distill's held-out report."""
    t0 = time.time()
    argv = distill_argv(cfg, paths)
    run_specx(argv, "draft")
    report = json.loads((paths.draft / "REPORT.json").read_text())
    # The fixture's own REPORT.json carries the numbers; the draft directory stays as the
    # fixture tests and the README describe it (model and tokenizer files only).
    (paths.draft / "REPORT.json").unlink()
    info = {
        "seconds": round(time.time() - t0, 1),
        "command": "vllm-specx " + " ".join(argv),
        "params": report["draft"]["params"],
        "pretrain": report["stages"]["pretrain"],
        "finetune": report["stages"]["finetune"],
        "distill_heldout": report["heldout"],
    }
    update_report(paths, "draft", info)


# --------------------------------------------------------------------------------------------
# Stage 5: report.
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def window_perplexity(model: Any, stream: torch.Tensor, seq_len: int, n_windows: int) -> float:
    """Perplexity over the first n non-overlapping windows of the held-out stream, each
    bos + (seq_len - 1) tokens as in training; every non-bos token is predicted once."""
    body = seq_len - 1
    n = min(n_windows, stream.numel() // body)
    x = stream[: n * body].long().view(n, body)
    x = torch.cat([torch.zeros(n, 1, dtype=torch.long), x], dim=1)
    nll, count = 0.0, 0
    for b in range(0, n, 16):
        chunk = x[b : b + 16]
        logits = model(input_ids=chunk).logits[:, :-1].float()
        nll += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            )
        )
        count += chunk[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def text_perplexity(model: Any, tokenizer: Any, texts: list[str], max_tokens: int) -> float:
    """Perplexity of the stored snippets' ``text`` (bos + at most max_tokens - 1 tokens each)."""
    nll, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"][:max_tokens]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(nll / count)


def block_efficiency(matches: list[bool], k: int) -> float:
    """Tokens per target forward for greedy speculative decoding with k drafts per round.

    ``matches[t]`` says whether the draft's greedy token equals the target's at position t of
    the target's greedy continuation given the exact prefix; along an accepted prefix the draft
    sees exactly that prefix, so the teacher-forced match array decides each round.
    """
    t, rounds = 0, 0
    while t < len(matches):
        a = 0
        while a < k and t + a < len(matches) and matches[t + a]:
            a += 1
        t += a + 1  # accepted drafts plus the target's own token (correction or bonus)
        rounds += 1
    return len(matches) / max(1, rounds)


def summarize(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {
        "mean": round(float(t.mean()), 4),
        "std": round(float(t.std(unbiased=False)), 4),
        "min": round(float(t.min()), 4),
        "max": round(float(t.max()), 4),
    }


@torch.no_grad()
def agreement_stats(
    target: Any, draft: Any, tokenizer: Any, prompts: list[str], new_tokens: int
) -> dict[str, Any]:
    per_prompt, all_match, by_offset, conf, tv_accept = [], [], {}, [], []
    matches_per_prompt: list[list[bool]] = []
    tf_mismatch = 0
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        cont = generate(target, ids, new_tokens, 0.0, None)[0]
        # Keep the continuation up to its first eos (inclusive): what a user would see.
        eos_pos = (cont == 1).nonzero()
        if eos_pos.numel():
            cont = cont[: int(eos_pos[0]) + 1]
        full = torch.cat([ids[0], cont])[None]
        span = slice(ids.shape[1] - 1, full.shape[1] - 1)  # positions predicting cont
        t_logits = target(input_ids=full).logits[0, span].float()
        d_logits = draft(input_ids=full).logits[0, span].float()
        t_greedy, d_greedy = t_logits.argmax(-1), d_logits.argmax(-1)
        tf_mismatch += int((t_greedy != cont).sum())
        match = (d_greedy == t_greedy).tolist()
        matches_per_prompt.append(match)
        per_prompt.append(sum(match) / len(match))
        all_match.extend(match)
        for off, m in enumerate(match):
            by_offset.setdefault(off, []).append(m)
        p_t, p_d = torch.softmax(t_logits, -1), torch.softmax(d_logits, -1)
        conf.extend(zip(p_t.max(-1).values.tolist(), match))
        # sum_x min(p, q): chance that standard speculative sampling at temperature 1 accepts.
        tv_accept.extend(torch.minimum(p_t, p_d).sum(-1).tolist())
    mean = sum(all_match) / len(all_match)
    offsets = sorted(by_offset)
    offset_curve = [sum(by_offset[o]) / len(by_offset[o]) for o in offsets]
    hist = [0] * 10
    for a in per_prompt:
        hist[min(9, int(a * 10))] += 1
    conf_buckets = {}
    for lo, hi in ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.01)):
        sel = [m for c, m in conf if lo <= c < hi]
        conf_buckets[f"{lo:.2f}-{min(hi, 1.0):.2f}"] = {
            "positions": len(sel),
            "agreement": round(sum(sel) / len(sel), 4) if sel else None,
        }
    # Lengths of runs of consecutive agreements: what speculative decoding actually harvests.
    runs, cur = [], 0
    for match in matches_per_prompt:
        for m in match + [False]:
            if m:
                cur += 1
            else:
                runs.append(cur)
                cur = 0
    return {
        "prompts": len(prompts),
        "positions": len(all_match),
        "greedy_agreement": round(mean, 4),
        "per_token_std": round(math.sqrt(mean * (1 - mean)), 4),
        "per_prompt": summarize(per_prompt),
        "per_prompt_histogram_0_to_1_by_0.1": hist,
        "by_offset_std": round(float(torch.tensor(offset_curve).std(unbiased=False)), 4),
        "by_offset_first8_mean": round(sum(offset_curve[:8]) / len(offset_curve[:8]), 4),
        "by_offset_last8_mean": round(sum(offset_curve[-8:]) / len(offset_curve[-8:]), 4),
        "by_target_confidence": conf_buckets,
        "agreement_run_length": summarize([float(r) for r in runs]),
        "expected_accept_prob_t1": round(sum(tv_accept) / len(tv_accept), 4),
        "greedy_block_efficiency": {
            f"k={k}": round(
                sum(block_efficiency(m, k) * len(m) for m in matches_per_prompt)
                / sum(len(m) for m in matches_per_prompt),
                4,
            )
            for k in (1, 2, 4, 8)
        },
        "teacher_forced_target_mismatch": tf_mismatch,
    }


@torch.no_grad()
def natural_text_agreement(
    target: Any, draft: Any, tokenizer: Any, texts: list[str], max_tokens: int
) -> dict[str, Any]:
    """Greedy agreement teacher-forced on real held-out code instead of target output.

    The target's greedy continuations drift into repetitive, easy-to-copy text; on real text
    both models are often unsure, so this is the harder, more text-like view of agreement.
    """
    per_text, all_match = [], []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"][:max_tokens]])
        t_next = target(input_ids=ids).logits[0, :-1].argmax(-1)
        d_next = draft(input_ids=ids).logits[0, :-1].argmax(-1)
        match = (t_next == d_next).tolist()
        per_text.append(sum(match) / len(match))
        all_match.extend(match)
    mean = sum(all_match) / len(all_match)
    return {
        "positions": len(all_match),
        "greedy_agreement": round(mean, 4),
        "per_token_std": round(math.sqrt(mean * (1 - mean)), 4),
        "per_text": summarize(per_text),
    }


def stage_report(cfg: BuildConfig, paths: Paths) -> dict[str, Any]:
    import safetensors
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(paths.target)
    target, draft = load_model(paths.target), load_model(paths.draft)
    from vllm_specx.fixtures import materialise_heldout  # the text, read back from the stdlib

    records = [
        materialise_heldout(json.loads(line))
        for line in paths.prompts.read_text().splitlines()
        if line
    ]
    if any(r is None for r in records):  # aligned with heldout_ids: none may be left out
        raise SystemExit("some held-out snippets are not in this Python's stdlib; build the "
                         "fixtures with the Python they were built with (see REPORT.json)")
    heldout_ids = torch.load(paths.work / "heldout_ids.pt")
    models: dict[str, Any] = {}
    for name, model, path in (("target", target, paths.target), ("draft", draft, paths.draft)):
        weights = path / "model.safetensors"
        models[name] = {
            "params": param_count(model),
            "config": {
                k: getattr(model.config, k)
                for k in (
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "intermediate_size",
                    "vocab_size",
                    "max_position_embeddings",
                    "tie_word_embeddings",
                )
            },
            "dtype": "float32",
            "safetensors_bytes": weights.stat().st_size,
            "dir_bytes": sum(p.stat().st_size for p in path.iterdir() if p.is_file()),
            "safetensors_sha256": sha256_file(weights),
            "heldout_ppl": round(
                window_perplexity(model, heldout_ids, cfg.seq_len, cfg.eval_windows), 4
            ),
            "heldout_prompt_text_ppl": round(
                text_perplexity(model, tokenizer, [r["text"] for r in records], cfg.seq_len), 4
            ),
        }
        log(f"report: {name} {json.dumps(models[name])}")
    agreement = agreement_stats(
        target, draft, tokenizer, [r["prompt"] for r in records], cfg.agree_new_tokens
    )
    agreement["natural_text"] = natural_text_agreement(
        target, draft, tokenizer, [r["text"] for r in records], cfg.seq_len
    )
    log(f"report: agreement {json.dumps(agreement)}")
    report = load_report(paths)
    stages = report.get("stages", {})
    report.update(
        {
            "description": (
                "Tiny Llama target/draft pair trained by scripts/build_fixture_models.py on the "
                "Python standard library's source text; draft self-distilled from the target."
            ),
            "models": models,
            "agreement": agreement,
            "eval": {
                "heldout_ppl": f"first {cfg.eval_windows} consecutive windows of the held-out "
                f"files' token stream, each bos + {cfg.seq_len - 1} tokens",
                "heldout_prompt_text_ppl": "the 'text' field of heldout_prompts.jsonl, "
                f"tokenized with bos and cut to {cfg.seq_len} tokens, all tokens pooled",
                "agreement": f"target greedy continuation ({cfg.agree_new_tokens} tokens, cut "
                "at eos) of each stored prompt; teacher-forced argmax of draft vs target. "
                "agreement.natural_text: the same comparison teacher-forced on the stored "
                "held-out texts (real code rather than the target's own output)",
            },
            "total_size_bytes": sum(m["dir_bytes"] for m in models.values()),
            "build_config": dataclasses.asdict(cfg),
            "versions": {
                "python_for_stdlib_text": stages.get("tokenizer", {}).get("python_version"),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "safetensors": safetensors.__version__,
                "platform": platform.platform(),
                "torch_threads": torch.get_num_threads(),
            },
            "seeds": {
                "base": cfg.seed,
                "target_init": cfg.seed + 1,
                "target_windows_and_batches": cfg.seed + 2,
                "distill": f"vllm-specx distill --seed {cfg.seed}: draft init {cfg.seed}, "
                f"corpus windows {cfg.seed + 1}, pretrain batches {cfg.seed + 2}, finetune "
                f"batches {cfg.seed + 3}, generation request i {cfg.seed} + i, held-out split "
                f"{cfg.seed}",
                "distill_prompts": f"{cfg.seed}:distill-prompts (snippet shuffle)",
            },
        }
    )
    report["training_seconds"] = round(
        sum(
            stages.get(s, {}).get("seconds", 0.0)
            for s in ("tokenizer", "target", "distill", "draft")
        ),
        1,
    )
    report["report_seconds"] = round(time.time() - t0, 1)
    paths.report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


# --------------------------------------------------------------------------------------------
# Stage head: the SpecDec++ acceptance head, trained by `vllm-specx train-head`.
# --------------------------------------------------------------------------------------------


def head_prompt_refs(
    cfg: BuildConfig, count: int | None = None, salt: str = "head-prompts"
) -> list[dict[str, Any]]:
    """Training prompts for the head (and, with another salt, for distillation): snippets of
    TRAIN files (never a held-out file), chosen like the held-out prompts, round-robin over
    files, as stdlib references."""
    stdlib, train_rel, _ = list_corpus(cfg)
    per_file = [
        make_prompt_records(cfg, rel, text)
        for rel in train_rel
        if (text := read_text(stdlib, rel)) is not None
    ]
    records = [recs[k] for k in range(cfg.prompts_per_file) for recs in per_file if k < len(recs)]
    # A seeded spread over the whole (alphabetical) file list rather than its head.
    random.Random(f"{cfg.seed}:{salt}").shuffle(records)
    return [
        {
            "id": i,
            "source": rec["source"],
            "line": rec["line"],
            "prompt_chars": len(rec["prompt"]),
            "text_chars": len(rec["text"]),
            "sha256": hashlib.sha256(rec["text"].encode("utf-8")).hexdigest(),
        }
        for i, rec in enumerate(records[: cfg.head_prompts if count is None else count])
    ]


def stage_head(cfg: BuildConfig, paths: Paths) -> None:
    from vllm_specx.cli import main as specx_main

    t0 = time.time()
    refs = head_prompt_refs(cfg)
    heldout_sources = {
        json.loads(line)["source"] for line in paths.prompts.read_text().splitlines() if line
    }
    overlap = heldout_sources & {r["source"] for r in refs}
    if overlap:
        raise RuntimeError(f"head training prompts overlap held-out files: {sorted(overlap)[:3]}")
    paths.head.mkdir(parents=True, exist_ok=True)
    prompts_file = paths.head / "train_prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in refs), encoding="utf-8")
    argv = [
        "train-head",
        "--target", shown(paths.target),
        "--draft", shown(paths.draft),
        "--prompts", shown(prompts_file),
        "-o", shown(paths.head),
        "--seed", str(cfg.seed),
        "--max-tokens", str(cfg.head_max_tokens),
        "--epochs", str(cfg.head_epochs),
        "--threads", str(cfg.threads),
    ]
    for t in cfg.head_temperatures:
        argv += ["--temperature", str(t)]
    if cfg.max_position_embeddings < 512:  # toy models: below the engine's default length
        argv += ["--engine-args", json.dumps({"max_model_len": cfg.max_position_embeddings})]
    log(f"head: vllm-specx {' '.join(argv)}")
    rc = specx_main(argv)
    if rc:
        raise RuntimeError(f"vllm-specx train-head exited with {rc}")
    config = json.loads((paths.head / "config.json").read_text())
    info = {
        "seconds": round(time.time() - t0, 1),
        "command": "vllm-specx " + " ".join(argv),
        "prompts": len(refs),
        "heldout_metrics": config["metrics"]["heldout"],
        "train_metrics": config["metrics"]["train"],
        "data": config["training"]["data"],
        "stage_seconds": config["training"]["seconds"],
        "head_bytes": sum(f.stat().st_size for f in paths.head.iterdir() if f.is_file()),
    }
    log(f"head: {json.dumps(info)}")
    update_report(paths, "head", info)


# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--stage",
        action="append",
        choices=[*STAGES, "all"],
        help="stage(s) to run, in pipeline order; repeatable (default: all)",
    )
    ap.add_argument("--out", type=Path, default=None, help="output dir (default fixtures/models)")
    ap.add_argument("--work-dir", type=Path, default=None, help="intermediate files")
    ap.add_argument("--quick", action="store_true", help="toy sizes and a few steps (smoke test)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--autocast",
        choices=("auto", "bf16", "off"),
        default=None,
        help="bf16 autocast for training matmuls (default auto: on with native CPU bf16)",
    )
    ap.add_argument(
        "--threads", type=int, choices=(1, 2), default=None, help="torch threads (default 1)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else BuildConfig()
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    if args.threads is not None:
        cfg = dataclasses.replace(cfg, threads=args.threads)
    autocast = args.autocast or cfg.autocast
    if autocast == "auto":
        autocast = "bf16" if cpu_has_native_bf16() else "off"
    cfg = dataclasses.replace(cfg, autocast=autocast)
    out = (args.out or REPO_ROOT / "fixtures" / "models").resolve()
    if args.work_dir is not None:
        work = args.work_dir.resolve()
    elif args.quick or args.out is not None:
        work = out / "_work"  # keep a throw-away build's intermediates next to it
    else:
        work = REPO_ROOT / ".cache" / "fixture_build"
    paths = Paths(out=out, work=work)
    wanted = set(args.stage or ["all"])
    # --quick skips the head unless asked for by name: a toy pair's head says nothing, and
    # its vLLM engine would double the smoke test's time.
    full = [s for s in STAGES if not (args.quick and s == "head" and "head" not in wanted)]
    stages = [s for s in full if "all" in wanted or s in wanted]

    # A fixed thread count, because float reductions (and so the weights) depend on it. One
    # by default: on a shared 2-core machine two OpenMP threads spin against other jobs and
    # ran 2-3x slower than one in measurements; an idle machine gains ~1.6x from --threads 2.
    torch.set_num_threads(cfg.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor "Loading weights" bars flood the build log
    torch.manual_seed(cfg.seed)
    log(f"build: stages {stages} out {out} work {work} python {sys.version.split()[0]}")
    t0 = time.time()
    # Other jobs on a shared machine stretch the stage times; the load explains a slow build.
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    for stage in stages:
        ts = time.time()
        if stage == "tokenizer":
            stage_tokenizer(cfg, paths)
        elif stage == "target":
            stage_target(cfg, paths)
        elif stage == "distill":
            stage_distill(cfg, paths)
        elif stage == "draft":
            stage_draft(cfg, paths)
        elif stage == "head":
            stage_head(cfg, paths)
        elif stage == "report":
            report = stage_report(cfg, paths)
            print(json.dumps(report, indent=2, sort_keys=True))
        log(f"stage {stage} took {time.time() - ts:.1f}s")
    wall = time.time() - t0
    log(f"build: done in {wall:.1f}s")
    if stages == full and paths.report.exists():
        # Kept only for complete builds: a partial rerun says nothing about the whole.
        report = load_report(paths)
        report["full_build"] = {
            "wall_seconds": round(wall, 1),
            "load_average_at_start": load_at_start,
            "cpu_count": os.cpu_count(),
        }
        paths.report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
