"""``vllm-specx``: the command line of the plugin.

    vllm-specx methods     the specx methods, their knobs and defaults
    vllm-specx bench       the benchmark (see ``vllm-specx bench --help``)
    vllm-specx train-head  train a SpecDec++ acceptance head for a draft model
    vllm-specx fetch-target  download and convert the real benchmark target, once
    vllm-specx distill     train a draft model for a target by self-distillation
    vllm-specx distill-eagle3  train an EAGLE-3 head for a Llama target
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def _model_runner(spec: Any) -> dict[str, Any]:
    """Where a method runs (docs/model-runners.md)."""
    return {
        "v2": spec.runs_on_v2,
        "v1_only": (spec.v1_reason if not spec.runs_on_v2 else
                    [f"{s.knob} = {str(s.value).lower()}: {s.why}"
                     for s in spec.v1_only_settings]),
        "v2_cudagraph": spec.v2_cudagraph if spec.runs_on_v2 else None,
    }


def _runner_text(spec: Any) -> str:
    if not spec.runs_on_v2:
        return f"V1 only: {spec.v1_reason}"
    stays = "; ".join(f"{s.knob} = {str(s.value).lower()} stays on V1"
                      for s in spec.v1_only_settings)
    return "Model Runner V2 and V1" + (f" ({stays})" if stays else "")


def _cmd_methods(args: argparse.Namespace) -> int:
    from vllm_specx.methods import METHODS, defaults_table_markdown

    if args.json:
        out = {
            name: {
                "vllm_method": s.vllm_method, "lossless": s.lossless, "available": s.available,
                "summary": s.summary, "model_runner": _model_runner(s),
                "knobs": {k.name: {"default": k.default, "allowed": k.allowed, "help": k.help}
                          for k in s.knobs},
            }
            for name, s in METHODS.items()
        }
        print(json.dumps(out, indent=2))
        return 0
    for name, spec in METHODS.items():
        status = "available" if spec.available else "not available yet in this version"
        print(f"{name}: {spec.summary} [{status}; runs on {_runner_text(spec)}]")
    print()
    print(defaults_table_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vllm_specx.methods import METHODS

    shipped = ", ".join(name for name, spec in METHODS.items() if spec.available)
    parser = argparse.ArgumentParser(
        prog="vllm-specx",
        description=f"New speculative-decoding methods for vLLM: {shipped}. "
        "Use them with vLLM itself: vllm serve <target> --speculative-config "
        "'{\"method\": \"mtad\", \"model\": \"<draft>\", \"num_speculative_tokens\": 4}'.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the specx methods, knobs and defaults")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_methods)

    try:
        from vllm_specx.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)

    from vllm_specx.training.cli import (
        add_distill_eagle3_parser,
        add_distill_parser,
        add_train_head_parser,
    )

    add_train_head_parser(sub)

    from vllm_specx.real_pair import add_fetch_target_parser

    add_fetch_target_parser(sub)
    add_distill_parser(sub)
    add_distill_eagle3_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # commands that record how they were run (distill's REPORT.json)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
