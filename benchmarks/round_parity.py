"""Per-step cost of a specx drafting round against vLLM's own drafter at equal drafts.

Every configuration gets its own in-process engine, all alive at once; each is warmed
up (a full generate that is not counted), then the timed passes are interleaved
(``A B C A B C ...``), so neither order nor warm-up favours a row. Batch 1, greedy:
equal drafts make every row do the same forwards, so the per-step difference is the
round's own host-side work::

    python benchmarks/round_parity.py --pair fixture -k 3
    python benchmarks/round_parity.py --pair real -k 1 --prompts 4 --max-tokens 32
    python benchmarks/round_parity.py --pair real --eagle3 -k 3

Reported per configuration: CPU ms and wall ms per decode step (median over the
repeats), the CPU ms spent inside the drafter's ``propose`` per step, steps, and
whether the outputs equal the first row's (greedy, equal drafts: they must).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from vllm_specx.bench.clocks import CpuClock


def _fixed(method: str) -> dict[str, Any]:
    """Settings that keep a specx method at exactly the drafts asked for: its cost control
    (which may draft fewer, or none) off, where the method has that knob."""
    from vllm_specx.methods import METHODS

    names = {knob.name for knob in METHODS[method].knobs}
    return {"cost_control": False} if "cost_control" in names else {}


def _configs(pair_draft: str, k: int, eagle3: str | None) -> list[tuple[str, dict[str, Any]]]:
    if eagle3 is not None:
        return [
            (f"eagle3 K={k}", {"method": "eagle3", "model": eagle3, "num_speculative_tokens": k}),
            # Without "adaptive" specx_eagle3 drafts exactly K (no cost control there).
            (f"specx_eagle3 K={k}", {"method": "specx_eagle3", "model": eagle3,
                                     "num_speculative_tokens": k}),
        ]
    return [
        (f"draft_model K={k}", {"method": "draft_model", "model": pair_draft,
                                "num_speculative_tokens": k}),
        (f"adaptive min=max={k}", {"method": "adaptive", "model": pair_draft,
                                   "num_speculative_tokens": k, "min_speculative_tokens": k,
                                   **_fixed("adaptive")}),
        (f"mtad B=1 K={k}", {"method": "mtad", "model": pair_draft, "num_speculative_tokens": k,
                             "num_beams": 1, **_fixed("mtad")}),
    ]


class _ProposeClock:
    """CPU seconds inside the drafter's ``propose`` (``propose``) and the rejection
    sampler's ``forward`` (``sampler``), wrapped on the instances."""

    def __init__(self, llm: Any) -> None:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        # V1 keeps the drafter as ``drafter``; Model Runner V2 (vLLM's default on a GPU) as
        # ``speculator``, whose entry point is ``propose`` too.
        drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
        self.propose = CpuClock()
        self.sampler = CpuClock()
        if drafter is not None:
            drafter.propose = self.propose.wrap(drafter.propose)
        # V1's sampler is an nn.Module (``forward``), vLLM's or the specx one; V2's is a
        # plain callable, left untimed (its column then reads 0).
        sampler = getattr(runner, "rejection_sampler", None)
        if sampler is not None and hasattr(sampler, "forward"):
            sampler.forward = self.sampler.wrap(sampler.forward)


def _run(llm: Any, prompts: list[str], max_tokens: int) -> tuple[float, float, int, list]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    cpu = wall = 0.0
    steps = 0
    outs: list[list[int]] = []
    for i, prompt in enumerate(prompts):  # batch 1: one request at a time
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
        first = True
        while engine.has_unfinished_requests():
            c0, w0 = time.process_time(), time.perf_counter()
            out = engine.step()
            c1, w1 = time.process_time(), time.perf_counter()
            if not first:  # decode steps only: the prefill step is the same for all rows
                cpu += c1 - c0
                wall += w1 - w0
                steps += 1
            first = False
            for o in out:
                if o.finished:
                    outs.append(list(o.outputs[0].token_ids))
    return cpu, wall, steps, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("fixture", "real"), default="fixture")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--eagle3", action="store_true", help="eagle3 vs specx_eagle3 (real pair)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", type=str, default=None, help="comma-separated row indices")
    ap.add_argument("--engine-args", type=json.loads, default={},
                    help="JSON of extra vllm.LLM keyword arguments for every engine (on a GPU, "
                         "e.g. '{\"gpu_memory_utilization\": 0.2, \"dtype\": \"bfloat16\"}')")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm_specx.engine import default_dtype, ensure_cpu_env, make_llm, shutdown_llm

    ensure_cpu_env()
    overrides: dict[str, Any] = {"max_num_seqs": 1}
    eagle3 = None
    from vllm_specx.bench.pairs import pair_inputs

    target, draft, prompts, pair_overrides = pair_inputs(args.pair, args.prompts)
    overrides.update(pair_overrides)
    if args.eagle3 and args.pair == "real":
        from vllm_specx import real_pair

        eagle3 = str(real_pair.eagle3_dir())
    overrides.update(args.engine_args)
    configs = _configs(draft, args.k, eagle3)
    if args.only:
        configs = [configs[int(i)] for i in args.only.split(",")]

    engines = []
    for name, cfg in configs:
        llm = make_llm(target, speculative_config=cfg, **overrides)
        clock = _ProposeClock(llm)
        _run(llm, prompts[:1], args.max_tokens)  # warm-up, not counted
        engines.append((name, llm, clock))

    rows: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": [], "prop": [],
                                                   "samp": []}
                                               for n, _ in configs}
    outputs: dict[str, list] = {}
    steps: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, llm, clock in engines:
            before, s_before = clock.propose.seconds, clock.sampler.seconds
            cpu, wall, n, outs = _run(llm, prompts, args.max_tokens)
            rows[name]["cpu"].append(1000 * cpu / n)
            rows[name]["wall"].append(1000 * wall / n)
            rows[name]["prop"].append(1000 * (clock.propose.seconds - before) / n)
            rows[name]["samp"].append(1000 * (clock.sampler.seconds - s_before) / n)
            outputs[name], steps[name] = outs, n
    ref = outputs[configs[0][0]]
    result = []
    for name, _ in configs:
        r = rows[name]
        result.append({
            "config": name,
            "cpu_ms_per_step": round(statistics.median(r["cpu"]), 3),
            "cpu_ms_spread": [round(min(r["cpu"]), 3), round(max(r["cpu"]), 3)],
            "wall_ms_per_step": round(statistics.median(r["wall"]), 3),
            "propose_cpu_ms_per_step": round(statistics.median(r["prop"]), 3),
            "sampler_cpu_ms_per_step": round(statistics.median(r["samp"]), 3),
            "decode_steps": steps[name],
            "async_scheduling": bool(dict((n, e) for n, e, _ in engines)[name]
                                     .llm_engine.vllm_config.scheduler_config.async_scheduling),
            "same_output_as_first_row": outputs[name] == ref,
        })
    for _, llm, _ in engines:
        shutdown_llm(llm)
    print(json.dumps({"pair": args.pair, "dtype": overrides.get("dtype", default_dtype()),
                      "engine_args": overrides, "k": args.k,
                      "prompts": len(prompts), "max_tokens": args.max_tokens,
                      "repeats": args.repeats, "load": os.getloadavg(), "rows": result},
                     indent=1))
    for r in result:
        print(f"{r['config']:24s} cpu {r['cpu_ms_per_step']:8.3f} ms/step {r['cpu_ms_spread']} "
              f"wall {r['wall_ms_per_step']:8.3f} propose-cpu {r['propose_cpu_ms_per_step']:7.3f} "
              f"sampler-cpu {r['sampler_cpu_ms_per_step']:7.3f} "
              f"steps {r['decode_steps']} async {r['async_scheduling']} "
              f"same {r['same_output_as_first_row']}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
