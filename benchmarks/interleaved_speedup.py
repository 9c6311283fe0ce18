"""Wall-clock speed-up over no speculation, with every configuration's timed runs
interleaved, so that neither the order of the rows nor a host (or GPU clock) that drifts
during the run favours one of them.

``vllm-specx bench`` runs its configurations one after another between two
no-speculation runs; on a host whose speed drifts by several percent within a run, the
row that ran on the faster stretch wins (docs/cost-control.md, "Acceptance kept longer and
depth decided online"). Here every configuration gets its own in-process engine, all alive
at once, each warmed up by an untimed pass of every prompt for 8 tokens (the batch's own
shapes before the first timed pass; the prefix cache is emptied before every timed pass,
``--keep-prefix-cache`` keeps it), and then the timed passes go
``none A B none A B ...``: each speed-up is the median of the repeats' tokens/s over the
no-speculation engine's median, with the spread of the repeats beside it::

    python benchmarks/interleaved_speedup.py --pair real --batch 1 \\
      --config '{"method": "adaptive", "name": "adaptive on"}' \\
      --config '{"method": "adaptive", "cost_control": false, "name": "adaptive off"}'

A ``--config`` is the ``speculative_config`` dict, plus an optional ``"name"`` and an
optional ``"engine_args"`` (extra ``vllm.LLM`` keyword arguments for that engine only,
e.g. ``{"async_scheduling": false}``); ``{"method": "none"}`` is no speculation (a second
no-speculation engine with other engine arguments, say). The first row is always vLLM
without speculation, with ``--engine-args`` only. Greedy (``--temperature 0``) rows
report whether their tokens equal that row's. With ``--continue-on-error`` a
configuration whose engine fails to start (say, CUDA graphs a method cannot take) is
listed under ``"failed"`` with its error and the other rows still run.

Every prompt runs ``--max-tokens`` tokens (``ignore_eos``): with ``--prompts`` equal to
``--batch`` that is one closed batch, all of whose requests finish together without
speculation, and whose makespan a speculative run stretches (the requests that accept less
finish last, on a shrinking batch). ``--min-tokens N`` spreads the prompts' lengths evenly
from ``N`` to ``--max-tokens`` (shuffled): with several times ``--batch`` prompts, freed
slots take the next request at different steps, as in a server's stream::

    python benchmarks/interleaved_speedup.py --pair real --batch 8 --prompts 32 \
      --min-tokens 16 --max-tokens 128 --config '{"method": "adaptive"}'

Each row also splits its process CPU time per generated token into the target's forward
(``target_forward_cpu_ms_per_token``: the target model's ``forward``, verification rows
included) and everything else (``other_cpu_ms_per_token``: scheduling, sampling, the
drafter's passes and plan). On a host whose speed swings from run to run, the target's
forward moves with it in every row alike, while what speculation adds outside the forward
shows in the second number, against no speculation's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import numpy as np


def _parse_config(text: str) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
    cfg = json.loads(text)
    if not isinstance(cfg, dict) or "method" not in cfg:
        raise SystemExit(f"--config must be a JSON object with a 'method', got {text!r}")
    name = str(cfg.pop("name", cfg["method"]))
    engine_args = cfg.pop("engine_args", {})
    if not isinstance(engine_args, dict):
        raise SystemExit(f"--config 'engine_args' must be a JSON object, got {engine_args!r}")
    return name, (None if cfg["method"] == "none" else cfg), engine_args


def _forward_clock(llm: Any) -> Any:
    """A :class:`~vllm_specx.bench.clocks.CpuClock` on the target model's ``forward``
    (either model runner: both call ``runner.model``), wrapped on the module instance."""
    from vllm_specx.bench.clocks import CpuClock
    from vllm_specx.testing.v2_engine import runner_of

    model = runner_of(llm).model
    clock = CpuClock()
    model.forward = clock.wrap(model.forward)
    return clock


def _run(llm: Any, prompts: list[str], params: Any | list[Any], fresh: bool = True,
         ) -> tuple[float, float, int, int, list]:
    """All prompts at once (the engine's ``max_num_seqs`` sets the batch; ``params``: one
    ``SamplingParams`` for all, or one per prompt): wall and CPU seconds, engine steps,
    generated tokens, and the token ids per prompt. ``fresh``: the prefix cache is emptied
    first (not timed), so the prompts are prefilled whole, as a server's new requests are:
    with the prompts cached from the run before, vLLM's EAGLE engines recompute their last
    cached block (the head needs its hidden states) where an engine without a head does
    not, 16 more prefill tokens per prompt than the no-speculation row."""
    if fresh:
        llm.reset_prefix_cache()
    engine = llm.llm_engine
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{tag}-{i}", prompt,
                           params[i] if isinstance(params, list) else params)
    outs: dict[int, list[int]] = {}
    steps = 0
    c0, w0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id.rsplit("-", 1)[1])] = list(o.outputs[0].token_ids)
        steps += 1
    c1, w1 = time.process_time(), time.perf_counter()
    ordered = [outs[i] for i in range(len(prompts))]
    return w1 - w0, c1 - c0, steps, sum(len(t) for t in ordered), ordered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("fixture", "real"), default="real")
    ap.add_argument("--config", action="append", default=[], help="a speculative_config "
                    "JSON (see the module doc); repeat for more rows")
    ap.add_argument("--batch", type=int, default=1, help="max_num_seqs of every engine")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=None,
                    help="give the prompts lengths spread evenly from this to --max-tokens "
                         "(in a shuffled order) instead of --max-tokens each: with more "
                         "prompts than --batch, freed slots take the next request at "
                         "different steps, as in a server's stream, instead of every "
                         "request of a batch finishing together (a closed batch, whose "
                         "makespan a speculative run stretches: docs/cost-control.md)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="time the prompts as the warm-up and the runs before left them in "
                         "the prefix cache (default: the cache is emptied before every timed "
                         "run, so every row prefills its prompts whole)")
    ap.add_argument("--engine-args", type=json.loads, default={},
                    help="JSON of extra vllm.LLM keyword arguments for every engine (on a GPU, "
                         "e.g. '{\"gpu_memory_utilization\": 0.1, \"dtype\": \"bfloat16\"}')")
    ap.add_argument("--continue-on-error", action="store_true",
                    help="a configuration whose engine fails to start or warm up is reported "
                    "(the report's 'failed') and left out, instead of ending the run")
    ap.add_argument("-o", "--output", default=None, help="write the JSON report here too")
    args = ap.parse_args()
    rows = [("none", None, {})] + [_parse_config(c) for c in args.config]

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specx.engine import default_dtype, ensure_cpu_env, make_llm, shutdown_llm

    ensure_cpu_env()
    from vllm import SamplingParams

    from vllm_specx.bench.pairs import pair_inputs

    target, draft, prompts, pair_overrides = pair_inputs(args.pair, args.prompts)
    overrides: dict[str, Any] = {"max_num_seqs": args.batch, **pair_overrides}
    overrides.update(args.engine_args)
    params: Any = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                 ignore_eos=True, seed=0 if args.temperature > 0 else None)
    if args.min_tokens is not None:
        if not 1 <= args.min_tokens <= args.max_tokens:
            raise SystemExit(f"--min-tokens must be in 1..--max-tokens ({args.max_tokens}), "
                             f"got {args.min_tokens}")
        lengths = np.linspace(args.min_tokens, args.max_tokens, len(prompts)).round()
        np.random.default_rng(0).shuffle(lengths)
        params = [params.clone() for _ in prompts]
        for p, n in zip(params, lengths):
            p.max_tokens = int(n)

    warm = SamplingParams(temperature=args.temperature, max_tokens=8, ignore_eos=True)
    engines = []
    failed: list[dict[str, str]] = []
    clocks: dict[str, Any] = {}
    for name, spec, engine_args in rows:
        if spec is not None and spec.get("method") not in ("ngram", "eagle3", "eagle",
                                                           "specx_eagle3", "specx_eagle",
                                                           "mtp", "specx_mtp"):
            spec.setdefault("model", draft)
        try:
            llm = make_llm(target, speculative_config=spec, **{**overrides, **engine_args})
            # Warm-up, not counted: every prompt at once for a few tokens, so that the
            # batch's own shapes (not only batch 1's) have run before the first timed pass.
            _run(llm, prompts, warm)
        except Exception as e:  # noqa: BLE001 -- one row's failure is a result, not the end
            if name == "none" or not args.continue_on_error:
                raise
            failed.append({"config": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            traceback.print_exc()
            print(f"{name}: failed to start or warm up: {failed[-1]['error']}", file=sys.stderr)
            continue
        if {**overrides, **engine_args}.get("enforce_eager", True):
            clocks[name] = _forward_clock(llm)
        # else: a compiled model's calls dispatch to its compiled code, past a wrapper
        # on the instance (or would trace it): no forward split for that row.
        sched = llm.llm_engine.vllm_config.scheduler_config
        engines.append((name, llm, bool(sched.async_scheduling)))

    timed: dict[str, dict[str, list[float]]] = {
        n: {"tps": [], "cpu": [], "fwd": []} for n, _, _ in engines}
    outputs: dict[str, list] = {}
    steps: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, llm, _ in engines:
            clock = clocks.get(name)
            fwd0 = clock.seconds if clock else 0.0
            wall, cpu, n_steps, tokens, outs = _run(llm, prompts, params,
                                                    fresh=not args.keep_prefix_cache)
            timed[name]["tps"].append(tokens / wall)
            timed[name]["cpu"].append(1000 * cpu / tokens)
            timed[name]["fwd"].append(
                1000 * (clock.seconds - fwd0) / tokens if clock else float("nan"))
            outputs[name], steps[name] = outs, n_steps
    base = statistics.median(timed["none"]["tps"])
    result = []
    for name, _, is_async in engines:
        tps = timed[name]["tps"]
        result.append({
            "config": name,
            "speedup": round(statistics.median(tps) / base, 3),
            "tokens_per_s": round(statistics.median(tps), 2),
            "spread": round((max(tps) - min(tps)) / statistics.median(tps), 3),
            "tokens_per_s_runs": [round(t, 2) for t in tps],
            "cpu_ms_per_token": round(statistics.median(timed[name]["cpu"]), 3),
            "target_forward_cpu_ms_per_token": (
                round(statistics.median(timed[name]["fwd"]), 3) if name in clocks else None),
            "other_cpu_ms_per_token": (round(statistics.median(
                [c - f for c, f in zip(timed[name]["cpu"], timed[name]["fwd"])]), 3)
                if name in clocks else None),
            "engine_steps": steps[name],
            "async_scheduling": is_async,
            "same_output_as_none": (outputs[name] == outputs["none"]
                                    if args.temperature == 0 else None),
        })
    from vllm_specx.bench.engine_run import read_drafter_stats
    from vllm_specx.bench.report import cost_control_line, tree_cost_control_line

    for row, (_, llm, _) in zip(result, engines):
        stats, _ = read_drafter_stats(llm)
        control = (stats or {}).get("cost_control")
        if control:  # the cost model the row ended with (over all its runs)
            row["cost_control"] = cost_control_line(control)
            # The drafter's work that skipped steps saved or left (first passes skipped,
            # catch-ups, retirements): counts, not times, so no host noise in them.
            row["idle_first_pass"] = control.get("idle_first_pass")
        tree = (stats or {}).get("tree_cost_control")
        if tree:  # a dynamic draft tree pruned by cost (what it kept, its model)
            row["tree_cost_control"] = tree_cost_control_line(tree)
    for _, llm, _ in engines:
        shutdown_llm(llm)
    report = {"pair": args.pair, "dtype": overrides.get("dtype", default_dtype()),
              "batch": args.batch, "engine_args": overrides, "prompts": len(prompts),
              "max_tokens": args.max_tokens, "min_tokens": args.min_tokens,
              "temperature": args.temperature,
              "repeats": args.repeats, "prefix_cache_kept": args.keep_prefix_cache,
              "load": os.getloadavg(), "rows": result, "failed": failed}
    print(json.dumps(report, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    for r in result:
        print(f"{r['config']:28s} {r['speedup']:6.3f}x  {r['tokens_per_s']:8.2f} tok/s "
              f"(spread {100 * r['spread']:.1f}%)  cpu {r['cpu_ms_per_token']:7.3f} ms/token "
              f"(forward {r['target_forward_cpu_ms_per_token']}, "
              f"other {r['other_cpu_ms_per_token']})  "
              f"steps {r['engine_steps']}  async {r['async_scheduling']}  "
              f"same {r['same_output_as_none']}", file=sys.stderr)
        if r.get("cost_control"):
            print(f"    cost control: {r['cost_control']}", file=sys.stderr)
        if r.get("tree_cost_control"):
            print(f"    tree cost control: {r['tree_cost_control']}", file=sys.stderr)
    for f in failed:
        print(f"{f['config']:28s} FAILED: {f['error'][:300]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
