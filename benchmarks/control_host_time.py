"""Host time of the cost control on a step that drafts, per part, without an engine.

A ``CostControl`` with a fixed cost model (acceptance learnt from scripted verified drafts,
so the plan drafts every step) over a confidence stop, driven the way a chain round drives
it: ``begin`` (learn from the last round's rejected counts), ``plan`` (the lengths and the
cost stop), the stop's ``step`` at each depth over a vocabulary-sized probability row, and
``end``. Median microseconds of each part over ``--steps`` steps, on the host's CPU with
one torch thread::

    python benchmarks/control_host_time.py --batch 1 --depths 3
    python benchmarks/control_host_time.py --batch 8 --all-retired

``--all-retired``: every request of the batch retired (``DraftKVHoles.retired``; batch
8-32 on a CPU host once drafting never paid): the steps plan nothing, so only begin, plan
and end run, as on such a batch's every step.

On a CPU host these parts are what the control adds to a step beyond the drafter's own
passes (docs/cost-control.md, "Interleaved runs after retirement and the shared rate").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--depths", type=int, default=3, help="stop-rule steps per round")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--all-retired", action="store_true",
                    help="every request retired: the plan drafts nothing")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from vllm_specx.algorithms.draft_length import StepCosts
    from vllm_specx.algorithms.draft_stop import ConfidenceStop
    from vllm_specx.glue.cost_model import CostControl

    ids = tuple(f"r{i}" for i in range(args.batch))
    control = CostControl(args.k, retired=(lambda: frozenset(ids)) if args.all_retired
                          else None)
    # A batch-1 CPU step of the real pair in the units of its fit (ms): drafting pays.
    control.fixed_costs = StepCosts(46.0, 2.0, 2.0, 2.5, 0.3, draft_round=6.0)
    device = torch.device("cpu")
    inner = ConfidenceStop(0.3, max_tokens=args.k)
    probs = torch.softmax(torch.randn(args.batch, args.vocab), -1)
    token_probs = torch.full((args.batch,), 0.9)
    rejected = torch.ones(args.batch, dtype=torch.int64)

    def step() -> list[float]:
        drafted = sum(control._drafted.get(r, 0) for r in ids)
        t0 = time.perf_counter()
        control.begin(ids, rejected, args.batch + drafted)
        t1 = time.perf_counter()
        plan = control.plan(ids, args.k, inner, device)
        t2 = time.perf_counter()
        drafts = bool(plan.caps.any())
        depths = args.depths if drafts else 0
        state = plan.rule.start(args.batch, device)
        for depth in range(depths):
            state, keep = plan.rule.step(state, depth, next_token_probs=token_probs,
                                         next_probs=probs)
            bool(keep.any())  # the round reads the live mask each depth
        t3 = time.perf_counter()
        confidences = getattr(plan.rule, "confidences", None)
        if drafts:
            control.end(ids, [args.depths] * args.batch, args.depths - 1,
                        args.batch * (args.depths - 1),
                        confidences=confidences(state) if confidences else None)
        else:
            control.end(ids, [0] * args.batch, 0, 0)
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]

    for _ in range(50):  # acceptance and calibration learnt; the plan drafts (unless retired)
        step()
    parts = [step() for _ in range(args.steps)]
    names = ("begin", "plan", f"stop rule x {0 if args.all_retired else args.depths} depths",
             "end")
    result = {n: round(1e6 * statistics.median(p[i] for p in parts), 1)
              for i, n in enumerate(names)}
    result["total"] = round(1e6 * statistics.median(sum(p) for p in parts), 1)
    result["drafted_every_step"] = bool(control.stats.all_zero_steps == 0)
    print(json.dumps({"batch": args.batch, "k": args.k, "all_retired": args.all_retired,
                      "microseconds": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
