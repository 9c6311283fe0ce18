"""``vllm-specx``: the command line of the plugin.

    vllm-specx methods     the specx methods, their knobs and defaults
    vllm-specx demo        a short offline generation through the plugin
    vllm-specx bench       the benchmark (see ``vllm-specx bench --help``)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence


def _cmd_methods(args: argparse.Namespace) -> int:
    from vllm_specx.methods import METHODS, defaults_table_markdown

    if args.json:
        out = {
            name: {
                "vllm_method": s.vllm_method, "lossless": s.lossless, "available": s.available,
                "summary": s.summary,
                "knobs": {k.name: {"default": k.default, "allowed": k.allowed, "help": k.help}
                          for k in s.knobs},
            }
            for name, s in METHODS.items()
        }
        print(json.dumps(out, indent=2))
        return 0
    for name, spec in METHODS.items():
        status = "available" if spec.available else "not available yet in this version"
        print(f"{name}: {spec.summary} [{status}]")
    print()
    print(defaults_table_markdown())
    return 0


DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    def __init__(self):\n",
    "    for i in range(",
]


def _cmd_demo(args: argparse.Namespace) -> int:
    """Generate a few completions without and with speculation, and compare them."""
    from vllm_specx.fixtures import fixture_model_dirs
    from vllm_specx.testing.engine import ensure_cpu_env, running_llm

    ensure_cpu_env()
    from vllm import SamplingParams

    target, draft = fixture_model_dirs()
    configs: list[tuple[str, dict | None]] = [("no speculation", None)]
    if args.config:
        configs += [(c, json.loads(c)) for c in args.config]
    else:
        from vllm_specx.methods import METHODS

        configs.append(("vLLM draft_model K=4", {"method": "draft_model", "model": str(draft),
                                                  "num_speculative_tokens": 4}))
        for name, spec in METHODS.items():
            if spec.available and spec.needs_draft_model:
                configs.append((f"specx {name}", {"method": name, "model": str(draft)}))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    baseline: list[str] | None = None
    for label, spec in configs:
        if spec is not None and "model" not in spec and spec.get("method") != "ngram":
            spec = {**spec, "model": str(draft)}
        with running_llm(target, speculative_config=spec) as llm:
            start = time.perf_counter()
            outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
            wall = time.perf_counter() - start
        texts = [o.outputs[0].text for o in outs]
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        same = "" if baseline is None else (
            "  (identical to no speculation)" if texts == baseline else "  (differs)")
        print(f"== {label}: {ntok} tokens in {wall:.2f} s{same}")
        if baseline is None:
            baseline = texts
            for prompt, text in zip(DEMO_PROMPTS, texts):
                print(f"--- {prompt!r}\n{prompt}{text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-specx",
        description="New speculative-decoding methods for vLLM: mtad, adaptive, specx_mtp. "
        "Use them with vLLM itself: vllm serve <target> --speculative-config "
        "'{\"method\": \"mtad\", \"model\": \"<draft>\", \"num_speculative_tokens\": 4}'.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the specx methods, knobs and defaults")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_methods)

    p = sub.add_parser("demo", help="a short offline generation through the plugin, "
                       "on the platform present, with the project's fixture models")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--config", action="append",
                   help="speculative config JSON to run (repeatable); default: vLLM "
                   "draft_model and every available specx method")
    p.set_defaults(func=_cmd_demo)

    try:
        from vllm_specx.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
