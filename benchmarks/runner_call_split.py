"""Where a decoding step's CPU time goes, call by call, in one real engine (no profiler).

Wraps the V1 model runner's step functions, the specx drafter's ``propose`` and its parts
(the plan before the first pass, the round, the draft-KV holes' skip and catch-up), the
cost control's ``begin`` / ``plan`` / ``end`` and the samplers, timing each call with the
calling thread's CPU clock; then warms the engine up and generates once, batch size
``--batch``, and prints per call: count, total, mean and median. The engine core runs in
this process (``make_llm``), so the numbers are the engine's own thread::

    python benchmarks/runner_call_split.py --temperature 1                    # no speculation
    python benchmarks/runner_call_split.py --temperature 1 \\
        --config '{"method": "adaptive", "num_speculative_tokens": 2}'

``--by-verified`` also splits the runner's calls per step by what the step verified: no
draft token, the first step verifying drafts after steps that verified none, or a step
verifying drafts after one that did too (the cost model's price of verifying, measured call
by call; the verified count is the one the cost control times the step with)::

    python benchmarks/runner_call_split.py --by-verified --prompts 8 \
        --config '{"method": "adaptive"}'

Run the rows one after another on a quiet host and compare their calls; the target's
forward moves by several percent between processes on a shared host, so compare what
lies outside it (``benchmarks/interleaved_speedup.py`` interleaves whole runs instead).
Real pair only (the target and drafter ``vllm-specx bench --pair real`` uses).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

RUNNER_CALLS = ("execute_model", "sample_tokens", "_prepare_inputs", "_build_attention_metadata",
                "_calc_spec_decode_metadata", "_model_forward", "_sample", "_bookkeeping_sync",
                "propose_draft_token_ids", "_update_states")


# Per step (the runner's execute_model calls so far): each call's CPU seconds, and the
# draft tokens that step verified (--by-verified).
STEP = [0]
PER_STEP: dict[int, dict[str, float]] = collections.defaultdict(
    lambda: collections.defaultdict(float))
VERIFIED: dict[int, int | None] = {}


def _timed(times: dict[str, list[float]], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if key == "runner.execute_model":
            STEP[0] += 1
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.thread_time() - start
            times[key].append(seconds)
            PER_STEP[STEP[0]][key] += seconds
    return call


def _record_verified(fn: Callable[..., Any]) -> Callable[..., Any]:
    def round_begins(self: Any, num_reqs: int, draft_tokens: int | None) -> Any:
        VERIFIED[STEP[0]] = draft_tokens
        return fn(self, num_reqs, draft_tokens)
    return round_begins


def _print_by_verified() -> None:
    """Median CPU ms per step of each call, by what the step verified (see module doc)."""
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for step, count in VERIFIED.items():
        before = VERIFIED.get(step - 1)
        if count is None or before is None:
            continue  # a step with prompt tokens, or one the cost model did not time
        groups["none" if count == 0 else ("first after none" if before == 0
                                          else "after drafts")].append(step)
    names = sorted(groups)
    print("median CPU ms per step by what it verified: "
          + ", ".join(f"{g} ({len(groups[g])} steps)" for g in names))
    for key in sorted({k for steps in groups.values() for s in steps for k in PER_STEP[s]}):
        cells = "  ".join(
            f"{g}: {1e3 * statistics.median(PER_STEP[s].get(key, 0.0) for s in groups[g]):8.3f}"
            for g in names)
        print(f"  {key:38s} {cells}")


def _wrap_class(times: dict[str, list[float]], cls: type, name: str, key: str) -> None:
    if hasattr(cls, name):
        setattr(cls, name, _timed(times, key, getattr(cls, name)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="null",
                    help="a speculative_config as JSON (the drafter's 'model' defaults to the "
                         "real pair's); null: no speculation")
    ap.add_argument("--batch", type=int, default=1, help="max_num_seqs")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--by-verified", action="store_true",
                    help="also split the runner's calls per step by what the step verified "
                         "(needs a drafter with cost control: it reports the counts)")
    ap.add_argument("--slowest", type=int, default=0,
                    help="also print each call's N slowest calls (their order in the run, us)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specx.engine import ensure_cpu_env, make_llm

    ensure_cpu_env()
    from vllm import SamplingParams

    from vllm_specx.bench.pairs import pair_inputs
    from vllm_specx.glue import chain_drafter, cost_model, draft_passes

    times: dict[str, list[float]] = collections.defaultdict(list)
    for cls, name, key in (
            (draft_passes.SpecxPasses, "propose", "drafter.propose"),
            (chain_drafter.ChainRound, "plan_before_first_pass", "drafter.plan_before_first_pass"),
            (chain_drafter.ChainRound, "draft_round", "drafter.draft_round"),
            (draft_passes.DraftKVHoles, "skip", "holes.skip"),
            (draft_passes.DraftKVHoles, "_catch_up_spans", "holes.catch_up_passes"),
            (cost_model.CostControl, "begin", "cost_control.begin"),
            (cost_model.CostControl, "plan", "cost_control.plan"),
            (cost_model.CostControl, "end", "cost_control.end")):
        _wrap_class(times, cls, name, key)
    if args.by_verified:  # only then: it runs inside cost_control.begin, which is timed
        cost_model.MeasuredCosts.round_begins = _record_verified(
            cost_model.MeasuredCosts.round_begins)

    spec = json.loads(args.config)
    target, draft, prompts, overrides = pair_inputs("real", args.prompts)
    if spec is not None:
        spec.setdefault("model", draft)
    llm = make_llm(target, speculative_config=spec, max_num_seqs=args.batch, **overrides)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    for name in RUNNER_CALLS:
        _wrap_class(times, type(runner), name, "runner." + name)
    _wrap_class(times, type(runner.sampler), "forward", "sampler.forward")
    rejection = getattr(runner, "rejection_sampler", None)
    if rejection is not None:
        _wrap_class(times, type(rejection), "forward", "rejection_sampler.forward")
    runner.model.forward = _timed(times, "target.forward", runner.model.forward)

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=0)
    llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=8,
                                         ignore_eos=True, seed=0), use_tqdm=False)
    times.clear()
    PER_STEP.clear()
    VERIFIED.clear()
    started = time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cpu = time.process_time() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"config {json.dumps(spec)}  batch {args.batch}  T {args.temperature}: "
          f"{tokens} tokens, process CPU {1e3 * cpu:.1f} ms ({1e3 * cpu / tokens:.2f} ms a token)")
    print(f"{'call':40s} {'calls':>6s} {'total ms':>10s} {'mean us':>10s} {'median us':>10s}")
    for key, values in sorted(times.items()):
        ordered = sorted(values)
        print(f"{key:40s} {len(values):6d} {1e3 * sum(values):10.1f} "
              f"{1e6 * sum(values) / len(values):10.1f} {1e6 * ordered[len(values) // 2]:10.1f}")
    if args.slowest:
        print(f"slowest {args.slowest} calls (call number: us)")
        for key, values in sorted(times.items()):
            slow = sorted(range(len(values)), key=lambda i: -values[i])[: args.slowest]
            print(f"  {key:38s} " + ", ".join(f"{i}: {1e6 * values[i]:.0f}" for i in slow))
    if args.by_verified:
        _print_by_verified()
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "kv_holes"):
        print("draft-KV holes:", json.dumps(drafter.kv_holes().as_dict()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
