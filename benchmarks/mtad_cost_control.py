"""mtad with its per-step depth control (``"cost_control": true``) against mtad at a fixed K
and against no speculation, timed interleaved (issue 32).

Three in-process engines, all alive at once, warmed up, timed runs interleaved
(``A B C A B C ...``, as ``zero_draft_step.py``), so the machine's load moves all three
alike:

* ``no speculation``;
* ``mtad K`` (``"cost_control": false``): every step drafts K (the default before);
* ``mtad cc`` (``"cost_control": true``): each request's depth 0..K per step from
  measured costs.

Every request generates ``--max-tokens`` tokens (``ignore_eos``); greedy at ``--temperature
0``, else seeded sampling. Reported per row (median over the repeats, with the spread):
generated tokens per CPU second and per wall second of the whole ``generate`` (prefill
included) and their ratio to no speculation, block efficiency (tokens per request-step
of the decode steps), the control's request-rounds per depth, and (greedy) whether
the outputs equal no speculation's::

    python benchmarks/mtad_cost_control.py --pair fixture --batch 1
    python benchmarks/mtad_cost_control.py --pair real --batch 8 --temperature 1

Quality (perplexity) and the other rates come from ``vllm-specx bench`` on the same
configurations; this script is for the timing, which a shared machine's load distorts
unless the rows are interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any


def _run(llm: Any, prompts: list[str], max_tokens: int, temperature: float,
         seed: int) -> dict[str, Any]:
    """All prompts at once (the batch is max_num_seqs): CPU and wall seconds of the whole
    run, generated tokens, decode request-steps and tokens, outputs in prompt order."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    tag = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                ignore_eos=True, seed=None if temperature == 0 else seed + i)
        engine.add_request(f"r{tag}-{i}", prompt, params)
    sched = engine.engine_core.engine_core.scheduler
    seen: dict[str, int] = {}
    req_steps = decode_tokens = 0
    outs: dict[int, list[int]] = {}
    c0, w0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        prefill = bool(sched.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        out = engine.step()
        for o in out:
            n = len(o.outputs[0].token_ids)
            if not prefill:
                req_steps += 1
                decode_tokens += n - seen.get(o.request_id, 0)
            seen[o.request_id] = n
            if o.finished:
                outs[int(o.request_id.rsplit("-", 1)[1])] = list(o.outputs[0].token_ids)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    return {"cpu": cpu, "wall": wall, "tokens": sum(len(v) for v in outs.values()),
            "req_steps": req_steps, "decode_tokens": decode_tokens,
            "outputs": [outs[i] for i in sorted(outs)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("fixture", "real"), default="fixture")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", type=int, default=4, help="mtad's K (default 4, its default)")
    ap.add_argument("--num-beams", type=int, default=None,
                    help="mtad's num_beams (default: its default)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specx.bench.pairs import pair_inputs
    from vllm_specx.engine import default_dtype, ensure_cpu_env, make_llm, shutdown_llm

    ensure_cpu_env()
    target, draft, prompts, overrides = pair_inputs(args.pair, max(args.batch, 4))
    overrides["max_num_seqs"] = args.batch
    spec: dict[str, Any] = {"method": "mtad", "model": draft, "num_speculative_tokens": args.k}
    if args.num_beams is not None:
        spec["num_beams"] = args.num_beams
    rows_cfg = [("no speculation", None),
                (f"mtad K={args.k}", {**spec, "cost_control": False}),
                ("mtad cc", {**spec, "cost_control": True})]
    engines = []
    for name, cfg in rows_cfg:
        llm = make_llm(target, speculative_config=cfg, **overrides)
        _run(llm, prompts, args.max_tokens, args.temperature, 0)  # warm-up, not counted
        engines.append((name, llm))

    runs: dict[str, list[dict[str, Any]]] = {n: [] for n, _ in rows_cfg}
    load = [os.getloadavg()[0]]
    for rep in range(args.repeats):
        for name, llm in engines:
            runs[name].append(_run(llm, prompts, args.max_tokens, args.temperature, 100 * rep))
        load.append(os.getloadavg()[0])
    base = runs[rows_cfg[0][0]]
    result = []
    for i, (name, llm) in enumerate(engines):
        r = runs[name]
        # Per repeat, against the no-speculation run next to it.
        cpu_x = [b["cpu"] / x["cpu"] for x, b in zip(r, base)]
        wall_x = [b["wall"] / x["wall"] for x, b in zip(r, base)]
        row: dict[str, Any] = {
            "config": name,
            "tok_per_cpu_s": round(statistics.median(x["tokens"] / x["cpu"] for x in r), 2),
            "tok_per_wall_s": round(statistics.median(x["tokens"] / x["wall"] for x in r), 2),
            "cpu_speedup": round(statistics.median(cpu_x), 3),
            "cpu_speedup_spread": [round(min(cpu_x), 3), round(max(cpu_x), 3)],
            "wall_speedup": round(statistics.median(wall_x), 3),
            "wall_speedup_spread": [round(min(wall_x), 3), round(max(wall_x), 3)],
            "block_efficiency": round(sum(x["decode_tokens"] for x in r)
                                      / max(sum(x["req_steps"] for x in r), 1), 3),
        }
        if args.temperature == 0:
            row["same_output_as_no_speculation"] = r[-1]["outputs"] == base[-1]["outputs"]
        if i > 0:
            drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
            cc = drafter.specx_stats().get("cost_control")
            if cc:
                row["request_rounds_per_depth"] = cc.get("depth_histogram")
                row["idle_first_pass"] = cc.get("idle_first_pass")
                row["model"] = cc.get("model")
        result.append(row)
    for _, llm in engines:
        shutdown_llm(llm)
    print(json.dumps({"pair": args.pair, "dtype": default_dtype(), "batch": args.batch,
                      "max_tokens": args.max_tokens, "temperature": args.temperature,
                      "repeats": args.repeats, "k": args.k, "load": load,
                      "rows": result}, indent=1))
    for r in result:
        print(f"{r['config']:16s} CPU {r['cpu_speedup']:.3f}x {r['cpu_speedup_spread']} "
              f"wall {r['wall_speedup']:.3f}x {r['wall_speedup_spread']} "
              f"block eff {r['block_efficiency']:.3f} depths {r.get('request_rounds_per_depth')} "
              f"same {r.get('same_output_as_no_speculation')}", file=sys.stderr)
    print(f"load average during the runs: {load}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
