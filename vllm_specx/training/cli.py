"""``vllm-specx train-head``: the command line of acceptance-head training.

    vllm-specx train-head --target T --draft D --prompts p.jsonl -o heads/my-head
"""

from __future__ import annotations

import argparse
import json
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
    engine_args = None
    if args.engine_args:
        try:
            engine_args = json.loads(args.engine_args)
        except json.JSONDecodeError as exc:
            print(f"vllm-specx train-head: --engine-args {args.engine_args!r}: not JSON "
                  f"({exc.msg}); allowed: a JSON object", file=sys.stderr)
            return 2
        if not isinstance(engine_args, dict):
            print(f"vllm-specx train-head: --engine-args {args.engine_args!r}: allowed: a JSON "
                  "object", file=sys.stderr)
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
