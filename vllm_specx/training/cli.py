"""``vllm-specx train-head``: the command line of acceptance-head training.

    vllm-specx train-head --target T --draft D --prompts p.jsonl -o heads/my-head
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from vllm_specx.training.head import HeadTrainOptions

_D = HeadTrainOptions()


def add_train_head_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train-head`` to the ``vllm-specx`` sub-commands (called by ``vllm_specx.cli``)."""
    p = subparsers.add_parser(
        "train-head",
        help="train a SpecDec++ acceptance head for a draft model (for method 'adaptive')",
        description=(
            "Train the acceptance-prediction head that the 'adaptive' method uses to stop "
            "drafting per request (SpecDec++). The target answers the prompts in vLLM; the "
            "draft, teacher-forced on the answers with transformers, samples one token per "
            "position, labelled with its acceptance probability min(1, p/q); token mixing "
            "and a soft binary cross-entropy weighted on the reject class train the head on "
            "the draft's final hidden states. Writes a head directory (config.json, "
            "model.safetensors, metrics.json) to pass as "
            "'acceptance_head' in the speculative config; prints and records the held-out "
            "loss and AUC. Deterministic for a seed on one machine."
        ),
    )
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument("--draft", type=Path, required=True,
                   help="draft model directory (the head is only valid for this draft)")
    p.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl",
                   help="training prompts: one JSON string, {\"prompt\": ...} object, or "
                   "stdlib reference (as in fixtures/models/head/train_prompts.jsonl) per "
                   "line; keep them apart from the prompts you benchmark on")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="output head directory (created; files in it are overwritten)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--seed", type=int, default=_D.seed,
                   help="seeds generation (request i: seed + i), draft sampling, mixing, the "
                   "held-out split, initialisation and shuffling (default: %(default)s)")
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="target sampling temperature for the responses, 0 = greedy; "
                   "repeatable: every prompt is answered at each (default: 1.0)")
    p.add_argument("--max-tokens", type=int, default=_D.max_tokens,
                   help="tokens generated per response (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=_D.epochs,
                   help="training epochs (default: %(default)s, as SpecDec++)")
    p.add_argument("--num-blocks", type=int, default=_D.num_blocks,
                   help="residual blocks x + SiLU(Wx + b) before the 2-way output "
                   "(default: %(default)s, as SpecDec++)")
    p.add_argument("--shared-blocks", action="store_true",
                   help="one block applied --num-blocks times (the SpecDec++ reference "
                   "checkpoints do this); default: independent blocks")
    p.add_argument("--reject-weight", type=float, default=_D.reject_weight,
                   help="loss weight w of the reject class (default: %(default)s, as SpecDec++)")
    p.add_argument("--mix-ratio", type=float, default=_D.mix_ratio,
                   help="token mixing r: probability that a position keeps the target's "
                   "token, with no loss there (default: %(default)s, as SpecDec++)")
    p.add_argument("--draft-tokens", choices=("sampled", "greedy"), default=_D.draft_tokens,
                   help="sampled: the draft samples each token from q and its label is "
                   "min(1, p/q) (SpecDec++, for sampled requests); greedy: the draft's argmax, "
                   "label 1 when it equals the target's argmax (for greedy requests) "
                   "(default: %(default)s)")
    p.add_argument("--heldout-fraction", type=float, default=_D.heldout_fraction,
                   help="fraction of responses held out for the reported loss and AUC "
                   "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=_D.batch_size,
                   help="token rows per optimiser step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=_D.lr,
                   help="peak learning rate, AdamW, warm-up then cosine (default: %(default)s)")
    p.add_argument("--score-batch-size", type=int, default=_D.score_batch_size,
                   help="responses per teacher-forced forward (default: %(default)s)")
    p.add_argument("--threads", type=int, default=_D.threads,
                   help="torch threads; results depend on it (default: %(default)s)")
    p.add_argument("--engine-args", type=str, default=None, metavar="JSON",
                   help="extra vllm.LLM keyword arguments for the generation engine, e.g. "
                   "'{\"max_model_len\": 2048}' (defaults: vllm_specx.engine.CPU_ENGINE_DEFAULTS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_head)
    return p


def cmd_train_head(args: argparse.Namespace) -> int:
    from vllm_specx.training.head import train_head

    for name in ("target", "draft"):
        path = getattr(args, name)
        if not (path / "config.json").is_file():
            print(f"vllm-specx train-head: --{name} {path}: not a model directory (no "
                  "config.json); allowed: a local Hugging Face model directory", file=sys.stderr)
            return 2
    if not args.prompts.is_file():
        print(f"vllm-specx train-head: --prompts {args.prompts}: no such file; allowed: a "
              "JSONL prompt file", file=sys.stderr)
        return 2
    engine_args, error = _engine_args_or_error("train-head", args.engine_args)
    if error:
        print(error, file=sys.stderr)
        return 2
    if args.num_prompts is not None and args.num_prompts < 1:
        print(f"vllm-specx train-head: --num-prompts {args.num_prompts}: allowed: an integer "
              ">= 1", file=sys.stderr)
        return 2
    options = HeadTrainOptions(
        seed=args.seed, epochs=args.epochs, num_blocks=args.num_blocks,
        shared_blocks=args.shared_blocks, reject_weight=args.reject_weight,
        mix_ratio=args.mix_ratio, max_tokens=args.max_tokens,
        temperatures=tuple(args.temperature or (1.0,)),
        heldout_fraction=args.heldout_fraction, batch_size=args.batch_size, lr=args.lr,
        score_batch_size=args.score_batch_size, threads=args.threads,
        draft_tokens=args.draft_tokens,
    )
    try:
        options.check()
    except ValueError as exc:
        print(f"vllm-specx {exc}", file=sys.stderr)
        return 2
    train_head(args.target, args.draft, args.prompts, args.output, options,
               max_prompts=args.num_prompts, engine_args=engine_args,
               progress=not args.no_progress)
    return 0


# --------------------------------------------------------------------------------------------
# vllm-specx distill
# --------------------------------------------------------------------------------------------


def _engine_args_or_error(command: str, text: str | None) -> tuple[dict[str, Any] | None, str]:
    """(``--engine-args`` parsed, "") or (None, one error line)."""
    if not text:
        return None, ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, (f"vllm-specx {command}: --engine-args {text!r}: not JSON ({exc.msg}); "
                      "allowed: a JSON object")
    if not isinstance(value, dict):
        return None, f"vllm-specx {command}: --engine-args {text!r}: allowed: a JSON object"
    return value, ""


def add_distill_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``distill`` to the ``vllm-specx`` sub-commands (called by ``vllm_specx.cli``)."""
    from vllm_specx.training.distill import (
        EMBED_INITS,
        SIZE_HELP,
        STAGES,
        DistillOptions,
    )

    d = DistillOptions()
    p = subparsers.add_parser(
        "distill",
        help="train a draft model for a target by self-distillation (the specialized-drafter "
        "recipe of Yi et al., 'Towards Fast Multilingual LLM Inference: Speculative Decoding "
        "and Specialized Drafters')",
        description=(
            "Train a small draft model for TARGET: the target answers the prompts in vLLM at "
            "several temperatures (self-distillation data), the drafter is optionally "
            "pretrained on raw text (--corpus), then fine-tuned on the target's answers. "
            "Writes a Hugging Face directory (config.json, model.safetensors, the target's "
            "tokenizer) that the draft_model, mtad and adaptive methods load as it is, and "
            "REPORT.json in it: agreement with the target's greedy token and acceptance "
            "estimates on held-out prompts. Stages (data, pretrain, finetune, report) are "
            "resumable: a stage finished in the work directory is skipped when the command "
            "is run again with the same inputs. Deterministic for a seed on one machine."
        ),
        epilog="example: vllm-specx distill --target fixtures/models/target --draft-config "
        "small --prompts prompts.jsonl --corpus texts/ -o drafts/my-draft",
    )
    p.add_argument("--target", type=Path, required=True,
                   help="target model directory (Hugging Face format); the drafter shares its "
                   "vocabulary and tokenizer")
    start = p.add_mutually_exclusive_group(required=True)
    start.add_argument("--init", type=Path, metavar="DRAFT_DIR",
                       help="start from this draft model directory (same vocabulary as the "
                       "target) instead of a new model")
    start.add_argument("--draft-config", metavar="SIZE",
                       help="start from a new Llama drafter of this size: " + SIZE_HELP)
    p.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl",
                   help="prompts the target answers: one JSON string, {\"prompt\": ...} object "
                   "or stdlib reference per line; a seeded --heldout-fraction of them is kept "
                   "for the report; keep them apart from the prompts you benchmark on")
    p.add_argument("--corpus", type=Path, metavar="DIR_OR_FILE", action="append",
                   help="raw text to pretrain on before distillation: a text file, or a "
                   "directory (every *.txt, *.md, *.rst, *.py, *.json(l), *.html, *.c, *.h "
                   "file under it); repeatable; without it there is no pretrain stage")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="output draft directory (created; REPORT.json is written into it)")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="intermediate files and stage markers (default: DIR.work beside the "
                   "output); delete it, or pass --restart, to start over")
    p.add_argument("--restart", action="store_true",
                   help="forget finished stages (their markers in the work directory and "
                   "REPORT.json) and run every stage again")
    p.add_argument("--stop-after", choices=STAGES, default=None,
                   help="stop after this stage (a later run with the same inputs resumes)")
    _add_data_stage_arguments(p, d)
    p.add_argument("--chat-template", action="store_true",
                   help="wrap each prompt in the target tokenizer's chat template as a user "
                   "turn (for instruction-tuned targets served through chat)")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per training row: corpus window length, and the cut of "
                   "prompt + answer rows (default: %(default)s)")
    p.add_argument("--pretrain-steps", type=int, default=d.pretrain_steps,
                   help="optimiser steps on the corpus (default: %(default)s; ignored without "
                   "--corpus)")
    p.add_argument("--pretrain-batch", type=int, default=d.pretrain_batch,
                   help="corpus windows per step (default: %(default)s)")
    p.add_argument("--pretrain-lr", type=float, default=d.pretrain_lr,
                   help="peak learning rate of pretraining (default: %(default)s)")
    p.add_argument("--finetune-steps", type=int, default=d.finetune_steps,
                   help="optimiser steps on the target's answers (default: %(default)s); 0 = "
                   "no distillation (a raw-text-only drafter; then only the held-out prompts "
                   "are answered, for the report)")
    p.add_argument("--finetune-batch", type=int, default=d.finetune_batch,
                   help="answers per step (default: %(default)s)")
    p.add_argument("--finetune-lr", type=float, default=d.finetune_lr,
                   help="peak learning rate of fine-tuning (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="AdamW weight decay of matrices; norm gains get none "
                   "(default: %(default)s)")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help="global gradient-norm clip (default: %(default)s)")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="the cosine schedule ends at this fraction of the peak rate "
                   "(default: %(default)s)")
    p.add_argument("--embed-init", choices=EMBED_INITS, default=d.embed_init,
                   help="new drafters only: 'target' starts the embedding from the target's, "
                   "projected on its principal directions to the draft width; 'random' as "
                   "usual (default: %(default)s)")
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="new drafters only: longest context (default: the target's)")
    _add_run_arguments(p, d)
    p.set_defaults(func=cmd_distill)
    _refuse_in_one_line(p, "distill")
    return p


def _add_data_stage_arguments(p: argparse.ArgumentParser, d: Any) -> None:
    """The arguments of the data stage ``distill`` and ``distill-eagle3`` share: the target
    answers the prompts in vLLM (``d``: the command's options dataclass, for the defaults)."""
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N prompts of --prompts (default: all)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds generation (request i: seed + i), the held-out split, "
                   "initialisation, corpus windows and shuffling (default: %(default)s)")
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="target sampling temperature of the distillation data, 0 = greedy; "
                   "repeatable, every prompt is answered at each (default: 0, 0.3, 0.7, 1.0 "
                   "as in Yi et al.'s specialized-drafter recipe)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="tokens generated per answer (default: %(default)s)")
    p.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction,
                   help="fraction of the prompts held out for REPORT.json (default: "
                   "%(default)s; at least one prompt)")
    p.add_argument("--heldout-prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help="held-out prompts of their own for REPORT.json, instead of a "
                   "--heldout-fraction of --prompts (every --prompts prompt then trains; a "
                   "prompt in both files is refused)")
    p.add_argument("--data-shard-prompts", type=int, default=d.data_shard_prompts,
                   help="prompts per data shard: the target's answers are saved shard by "
                   "shard in the work directory, and a killed data stage resumes from its "
                   "last complete shard (default: %(default)s)")


def _add_run_arguments(p: argparse.ArgumentParser, d: Any) -> None:
    """The arguments ``distill`` and ``distill-eagle3`` share for how a run saves, computes
    and reports (``d``: the command's options dataclass, for the defaults)."""
    from vllm_specx.training.distill import AUTOCAST_MODES, SAVE_DTYPES

    p.add_argument("--save-dtype", choices=SAVE_DTYPES, default=d.save_dtype,
                   help="dtype of the saved weights; bfloat16 halves the size on disk, vLLM "
                   "casts to the engine's dtype when loading (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads; results depend on it (default: %(default)s)")
    p.add_argument("--autocast", choices=AUTOCAST_MODES, default=d.autocast,
                   help="bf16 autocast of the training forward: auto = on where the CPU has "
                   "native bf16 (AMX/AVX512-BF16) (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default=d.device,
                   help="where training (and distill-eagle3's features) run: cuda needs a "
                   "CUDA device torch can see, auto takes one when there is one; the vLLM "
                   "engines pick their own platform (default: %(default)s)")
    p.add_argument("--engine-args", type=str, default=None, metavar="JSON",
                   help="extra vllm.LLM keyword arguments for the engines, e.g. "
                   "'{\"max_model_len\": 2048}' (defaults: vllm_specx.engine.CPU_ENGINE_DEFAULTS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _heldout_or_device_error(command: str, args: argparse.Namespace) -> str:
    """One error line for a missing --heldout-prompts file or a --device this machine does
    not have (checked before any stage starts), or ""."""
    from vllm_specx.training.distill import resolve_device

    if args.heldout_prompts is not None and not args.heldout_prompts.is_file():
        return (f"vllm-specx {command}: --heldout-prompts {args.heldout_prompts}: no such "
                "file; allowed: a JSONL prompt file")
    try:
        resolve_device(args.device)
    except ValueError as exc:
        return f"vllm-specx {command}: {exc}"
    return ""


def _refuse_in_one_line(p: argparse.ArgumentParser, command: str) -> None:
    """argparse's own refusals (a missing or unknown flag) as one line, like the others."""

    def one_line_error(message: str) -> None:
        print(f"vllm-specx {command}: {message}; see vllm-specx {command} --help",
              file=sys.stderr)
        raise SystemExit(2)

    p.error = one_line_error  # type: ignore[method-assign]


def cmd_distill(args: argparse.Namespace) -> int:
    from vllm_specx.training.distill import (
        STAGES,
        DistillJob,
        DistillOptions,
        default_work_dir,
        distill,
        parse_draft_size,
    )

    def refuse(message: str) -> int:
        print(message, file=sys.stderr)
        return 2

    for flag, path in (("--target", args.target), ("--init", args.init)):
        if path is not None and not (path / "config.json").is_file():
            return refuse(f"vllm-specx distill: {flag} {path}: not a model directory (no "
                          "config.json); allowed: a local Hugging Face model directory")
    if not args.prompts.is_file():
        return refuse(f"vllm-specx distill: --prompts {args.prompts}: no such file; allowed: "
                      "a JSONL prompt file")
    error = _heldout_or_device_error("distill", args)
    if error:
        return refuse(error)
    for corpus in args.corpus or []:
        if not corpus.exists():
            return refuse(f"vllm-specx distill: --corpus {corpus}: no such file or "
                          "directory; allowed: a text file or a directory of text files")
    if args.num_prompts is not None and args.num_prompts < 1:
        return refuse(f"vllm-specx distill: --num-prompts {args.num_prompts}: allowed: an "
                      "integer >= 1")
    engine_args, error = _engine_args_or_error("distill", args.engine_args)
    if error:
        return refuse(error)
    shape = None
    if args.draft_config is not None:
        try:
            shape = parse_draft_size(args.draft_config)
        except ValueError as exc:
            return refuse(f"vllm-specx {exc}")
    if args.init is not None:
        try:
            t_vocab = json.loads((args.target / "config.json").read_text())
            d_vocab = json.loads((args.init / "config.json").read_text())
            t_vocab = t_vocab.get("text_config", t_vocab).get("vocab_size")
            d_vocab = d_vocab.get("text_config", d_vocab).get("vocab_size")
        except (OSError, json.JSONDecodeError, AttributeError):
            t_vocab = d_vocab = None
        if t_vocab != d_vocab:
            return refuse(f"vllm-specx distill: --init {args.init}: vocabulary {d_vocab} differs "
                          f"from the target's {t_vocab}; allowed: a drafter with the target's "
                          "vocabulary")
    options = DistillOptions(
        seed=args.seed,
        temperatures=tuple(args.temperature) if args.temperature else DistillOptions().temperatures,
        max_tokens=args.max_tokens, chat_template=args.chat_template,
        heldout_fraction=args.heldout_fraction, seq_len=args.seq_len,
        pretrain_steps=args.pretrain_steps, pretrain_batch=args.pretrain_batch,
        pretrain_lr=args.pretrain_lr, finetune_steps=args.finetune_steps,
        finetune_batch=args.finetune_batch, finetune_lr=args.finetune_lr,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        min_lr_ratio=args.min_lr_ratio, embed_init=args.embed_init,
        save_dtype=args.save_dtype, threads=args.threads, autocast=args.autocast,
        max_position_embeddings=args.max_position_embeddings,
        data_shard_prompts=args.data_shard_prompts, device=args.device,
    )
    try:
        options.check()
    except ValueError as exc:
        return refuse(f"vllm-specx {exc}")
    if args.init is not None and (args.embed_init != "random"
                                  or args.max_position_embeddings is not None):
        return refuse("vllm-specx distill: --embed-init/--max-position-embeddings apply to new "
                      "drafters only; allowed with --draft-config, not with --init")
    if args.corpus is None and args.finetune_steps == 0:
        return refuse("vllm-specx distill: --finetune-steps 0 without --corpus would train "
                      "nothing; allowed: --finetune-steps >= 1, or a --corpus to pretrain on")
    work = args.work_dir or default_work_dir(args.output)
    if args.restart:
        for name in [f"{s}.done.json" for s in STAGES[:3]] + ["options.json"]:
            (work / name).unlink(missing_ok=True)
        (args.output / "REPORT.json").unlink(missing_ok=True)
        # Redo all means the answers too, not a reload of the shards they were saved in.
        shutil.rmtree(work / "data_shards", ignore_errors=True)
    job = DistillJob(
        target=args.target, prompts=args.prompts, out_dir=args.output, init=args.init,
        shape=shape, corpus=args.corpus, work_dir=work, max_prompts=args.num_prompts,
        engine_args=engine_args, heldout_prompts=args.heldout_prompts,
        command=" ".join(["vllm-specx", *map(shlex.quote, getattr(args, "argv", []))]),
    )
    try:
        distill(job, options, progress=not args.no_progress, stop_after=args.stop_after)
    except ValueError as exc:
        # Problems found only once inputs are read (a resumed run with other inputs, a corpus
        # too small for one window): still one line, no traceback.
        if str(exc).startswith("distill:"):
            return refuse(f"vllm-specx {exc}")
        raise
    return 0


# --------------------------------------------------------------------------------------------
# vllm-specx distill-eagle3
# --------------------------------------------------------------------------------------------


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip()) if text.strip() else ()


def add_distill_eagle3_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``distill-eagle3`` to the ``vllm-specx`` sub-commands."""
    from vllm_specx.training.eagle3 import EAGLE3_STAGES, Eagle3Options

    d = Eagle3Options()
    p = subparsers.add_parser(
        "distill-eagle3",
        help="train an EAGLE-3 head for a Llama target (Li et al., 'EAGLE-3: Scaling up "
        "Inference Acceleration of Large Language Models via Training-Time Test') that vLLM's "
        "eagle3 method and specx_eagle3 load as it is",
        description=(
            "Train an EAGLE-3 head for TARGET: the target answers the prompts in vLLM at "
            "several temperatures (the data stage of 'vllm-specx distill', shared: one work "
            "directory serves both), the target is teacher-forced on those answers (and on "
            "raw-text windows with --corpus) to cache its auxiliary and final hidden states, "
            "a draft vocabulary is chosen from the target's greedy-token frequencies, and "
            "one decoder layer is trained with the drafting steps unrolled exactly as vLLM "
            "runs them (training-time test), against the target's distribution over the "
            "draft vocabulary. Writes a head directory (config.json, model.safetensors) in "
            "vLLM's eagle3 format and REPORT.json: vocabulary coverage, the training curve "
            "(held-out agreement per drafting step against tokens and minutes) and the head "
            "served by vLLM's eagle3 on the held-out prompts at each --report-k (block "
            "efficiency, first-draft acceptance, greedy output against no speculation). "
            "Stages are resumable, training from its last checkpoint. Deterministic for a "
            "seed on one machine and thread count."
        ),
        epilog="example: vllm-specx distill-eagle3 --target fixtures/models/target --prompts "
        "prompts.jsonl -o heads/my-eagle3 --steps 2000 --max-minutes 60",
    )
    p.add_argument("--target", type=Path, required=True,
                   help="target model directory (a Llama model in Hugging Face format)")
    p.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl",
                   help="prompts the target answers (as for 'distill'); a seeded "
                   "--heldout-fraction of them is kept for the report")
    p.add_argument("--corpus", type=Path, metavar="DIR_OR_FILE", action="append",
                   help="raw text: --corpus-windows windows of it are added to the training "
                   "rows (repeatable)")
    p.add_argument("--corpus-windows", type=int, default=d.corpus_windows,
                   help="raw-text windows of --seq-len tokens (default: %(default)s)")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="DIR",
                   help="output head directory (created; REPORT.json is written into it)")
    p.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                   help="cached data, features and training checkpoints (default: DIR.work "
                   "beside the output)")
    p.add_argument("--restart", action="store_true",
                   help="forget finished stages except the data and run them again")
    p.add_argument("--stop-after", choices=EAGLE3_STAGES, default=None,
                   help="stop after this stage (a later run with the same inputs resumes)")
    _add_data_stage_arguments(p, d)
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per training row (default: %(default)s)")
    p.add_argument("--feature-shard-rows", type=int, default=d.feature_shard_rows,
                   help="rows per features shard: the target's hidden states are saved shard "
                   "by shard, and a killed features stage resumes from its last complete "
                   "shard (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="draft vocabulary size (default: %(default)s; the target's whole "
                   "vocabulary at most)")
    p.add_argument("--aux-layers", type=_int_list, default=None, metavar="I,J,K",
                   help="target layers whose inputs fc reads (default: vLLM's for Llama, "
                   "2, L/2, L-3)")
    p.add_argument("--intermediate", type=int, default=None,
                   help="MLP width of the head's layer (default: the target's)")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                   help="drafting steps unrolled in training (default: %(default)s)")
    p.add_argument("--ttt-decay", type=float, default=d.ttt_decay,
                   help="loss weight of step s is decay^(s-1) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps,
                   help="optimiser steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch,
                   help="rows per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr,
                   help="peak learning rate, AdamW, warm-up then cosine (default: %(default)s)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this many minutes even if --steps are not done "
                   "(recorded in REPORT.json)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="held-out curve point and checkpoint every N steps "
                   "(default: %(default)s)")
    p.add_argument("--report-k", type=_int_list, default=d.report_k, metavar="K1,K2",
                   help="num_speculative_tokens served in vLLM for the report; empty: no "
                   "engine report (default: 1,2,3,4)")
    p.add_argument("--report-max-tokens", type=int, default=d.report_max_tokens,
                   help="tokens generated per held-out prompt in the report "
                   "(default: %(default)s)")
    _add_run_arguments(p, d)
    p.set_defaults(func=cmd_distill_eagle3)
    _refuse_in_one_line(p, "distill-eagle3")
    return p


def cmd_distill_eagle3(args: argparse.Namespace) -> int:
    from vllm_specx.training.distill import default_work_dir
    from vllm_specx.training.eagle3 import Eagle3Job, Eagle3Options, distill_eagle3

    def refuse(message: str) -> int:
        print(message, file=sys.stderr)
        return 2

    if not (args.target / "config.json").is_file():
        return refuse(f"vllm-specx distill-eagle3: --target {args.target}: not a model "
                      "directory (no config.json); allowed: a local Hugging Face model directory")
    cfg = json.loads((args.target / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    if cfg.get("model_type") != "llama":
        return refuse(f"vllm-specx distill-eagle3: --target {args.target}: model_type "
                      f"{cfg.get('model_type')!r}; allowed: a Llama target (vLLM's eagle3 "
                      "head is a Llama layer)")
    layers = int(cfg.get("num_hidden_layers", 0))
    if args.aux_layers is not None and (len(args.aux_layers) == 0 or any(
            not 0 <= i < layers for i in args.aux_layers)):
        return refuse(f"vllm-specx distill-eagle3: --aux-layers {list(args.aux_layers)}: "
                      f"allowed: one or more layer indices in 0..{layers - 1}")
    if not args.prompts.is_file():
        return refuse(f"vllm-specx distill-eagle3: --prompts {args.prompts}: no such file; "
                      "allowed: a JSONL prompt file")
    error = _heldout_or_device_error("distill-eagle3", args)
    if error:
        return refuse(error)
    for corpus in args.corpus or []:
        if not corpus.exists():
            return refuse(f"vllm-specx distill-eagle3: --corpus {corpus}: no such file or "
                          "directory; allowed: a text file or a directory of text files")
    engine_args, error = _engine_args_or_error("distill-eagle3", args.engine_args)
    if error:
        return refuse(error)
    options = Eagle3Options(
        seed=args.seed,
        temperatures=tuple(args.temperature) if args.temperature else Eagle3Options().temperatures,
        max_tokens=args.max_tokens, heldout_fraction=args.heldout_fraction,
        seq_len=args.seq_len, corpus_windows=args.corpus_windows,
        draft_vocab=args.draft_vocab,
        aux_layer_ids=tuple(args.aux_layers) if args.aux_layers else None,
        intermediate=args.intermediate, ttt_steps=args.ttt_steps, ttt_decay=args.ttt_decay,
        steps=args.steps, batch=args.batch, lr=args.lr, max_minutes=args.max_minutes,
        eval_every=args.eval_every, report_k=tuple(args.report_k),
        report_max_tokens=args.report_max_tokens, save_dtype=args.save_dtype,
        threads=args.threads, autocast=args.autocast,
        data_shard_prompts=args.data_shard_prompts, device=args.device,
        feature_shard_rows=args.feature_shard_rows,
    )
    try:
        options.check()
    except ValueError as exc:
        return refuse(f"vllm-specx {exc}")
    work = args.work_dir or default_work_dir(args.output)
    if args.restart:
        for name in ("features", "vocab", "train"):
            (work / f"eagle3_{name}.done.json").unlink(missing_ok=True)
        (work / "eagle3_train_state.pt").unlink(missing_ok=True)
        (args.output / "REPORT.json").unlink(missing_ok=True)
        shutil.rmtree(work / "eagle3_feature_shards", ignore_errors=True)
    job = Eagle3Job(
        target=args.target, prompts=args.prompts, out_dir=args.output, work_dir=work,
        corpus=args.corpus, max_prompts=args.num_prompts, engine_args=engine_args,
        heldout_prompts=args.heldout_prompts,
        command=" ".join(["vllm-specx", *map(shlex.quote, getattr(args, "argv", []))]),
    )
    try:
        distill_eagle3(job, options, progress=not args.no_progress, stop_after=args.stop_after)
    except ValueError as exc:
        # Problems found once inputs are read (held-out prompts that are also training
        # prompts): one line, no traceback.
        if str(exc).startswith("distill"):
            return refuse(f"vllm-specx {exc}")
        raise
    return 0
