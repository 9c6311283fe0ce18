"""Where a decoding step's time goes: split a py-spy profile of ``vllm-specx bench``.

Runs one engine (the bench's ``run_config``: warm-up, then the timed generation) under
``py-spy record`` and splits the samples taken while it generated (``_timed_generation``)::

    python benchmarks/profile_split.py --dtype bfloat16 --batch 1           # no speculation
    python benchmarks/profile_split.py \\
        --config '{"method": "draft_model", "num_speculative_tokens": 2}'
    python benchmarks/profile_split.py --raw /tmp/prof.txt                  # split a saved profile

Categories: inside a model's ``forward``/``compute_logits`` (the drafter's when under its
``propose``, else the target's): attention (vllm-specx's reference attention ops and
vLLM's CPU attention backend), linear layers (vLLM's ``cpu_unquantized_gemm``), the rest
of the model; the drafter's ``propose`` outside its model; the sampler
(``vllm/v1/sample``), the scheduler (``vllm/v1/core``); the rest (input preparation,
output processing, the bench's own loop).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:]*):?(?P<line>\d*)\)$")


def frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for part in stack.split(";"):
        m = FRAME.match(part.strip())
        out.append((m["func"], m["file"]) if m else (part, ""))
    return out


def _is(func: str, name: str) -> bool:
    """py-spy names methods ``Class.method``."""
    return func == name or func.endswith("." + name)


def category(stack: list[tuple[str, str]]) -> str:
    in_draft = in_model = False
    for func, file in stack:
        if (_is(func, "propose") and "spec_decode" in file) or "proposer" in file:
            in_draft = True
        if (_is(func, "forward") or _is(func, "compute_logits")) and (
                "model_executor/models" in file):
            in_model = True
        if not in_model:
            continue
        who = "draft" if in_draft else "target"
        if "cpu_ops/attention" in file or "attention/backends/cpu_attn" in file:
            return f"{who}: attention"
        if _is(func, "cpu_unquantized_gemm") or "cpu_ops/linear" in file:
            return f"{who}: linear layers"
    if in_draft:
        return "draft: rest of the model" if in_model else "draft: proposer (not the model)"
    if in_model:
        return "target: rest of the model"
    # vllm-specx's own step work outside the models (trees: issue 37), by the innermost
    # vLLM or vllm-specx frame (the tree step's wrappers also sit above vLLM's own input
    # preparation and sampling, which are not theirs).
    for _func, file in reversed(stack):
        if "vllm_specx/glue/sampler" in file or "vllm_specx/algorithms/draft_tree" in file:
            return "specx sampler (chain/tree rule)"
        if "vllm_specx/glue/tree_step" in file:
            return "tree step glue (masks, KV move)"
        if "vllm/" in file or "vllm_specx/" in file:
            break
    for _func, file in stack:
        if "vllm/v1/sample" in file:
            return "sampler"
        if "vllm/v1/core" in file:
            return "scheduler"
    return "rest"


def split(path: str) -> Counter:
    """Samples per category, of those taken while the engine generated."""
    total: Counter = Counter()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if "_timed_generation" in stack and count.isdigit():
                total[category(frames(stack))] += int(count)
    return total


def run_child(args: argparse.Namespace) -> None:
    """The profiled process: one bench run of one configuration."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specx import real_pair
    from vllm_specx.bench.engine_run import Sampling, run_config
    from vllm_specx.bench.prompts import read_jsonl

    spec = json.loads(args.config) if args.config else None
    if spec is not None and "model" not in spec and spec.get("method") != "ngram":
        spec["model"] = str(real_pair.draft_dir())
    prompts = read_jsonl(real_pair.HELDOUT_PROMPTS, args.batch).prompts
    res = run_config(
        str(real_pair.ensure_target()), spec, prompts,
        Sampling(args.temperature, 0, 1.0, args.max_tokens, 0, ignore_eos=True),
        engine_overrides={"max_num_seqs": args.batch, "kv_cache_memory_bytes": 256 << 20,
                          **({"dtype": args.dtype} if args.dtype else {})},
    )
    tokens = sum(len(t.token_ids) for t in res.traces)
    print(f"wall {res.wall_s:.2f} s, {tokens} tokens, {tokens / res.wall_s:.2f} tok/s, "
          f"{1e3 * res.wall_s / max(1, len(res.steps)):.1f} ms per engine step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--raw", default=None, help="split this py-spy raw profile, run nothing")
    ap.add_argument("--config", default=None, help="speculative config JSON (default: none)")
    ap.add_argument("--dtype", default=None, help="default: the engine default")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return 0
    raw = args.raw
    if raw is None:
        raw = tempfile.mktemp(suffix=".txt", prefix="specx-prof-")
        cmd = ["py-spy", "record", "-r", str(args.rate), "-f", "raw", "-o", raw, "--",
               sys.executable, __file__, "--child", *sys.argv[1:]]
        subprocess.run(cmd, check=True)
    total = split(raw)
    n = sum(total.values())
    print(f"{n} samples while generating ({raw})")
    for cat, count in total.most_common():
        print(f"  {cat:32s} {count:6d}  {100 * count / n:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
