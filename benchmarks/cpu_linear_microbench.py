"""How fast is one forward's worth of linear layers of SmolLM2-135M on this CPU?

Times the target's weight matrices (vLLM's merged layout: per layer qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536; 30 layers; plus the 49152x576 lm_head, 121
GEMMs) for x of 1..N rows, per dtype and per linear variant:

* ``F.linear``       -- what vLLM's CPU engine calls without its compiled ops;
* ``W @ x.T``        -- the same product with the weight as the left operand (the
  matrix-vector-friendly form), transposed back and made contiguous;
* ``mkldnn packed``  -- torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``)
  on a weight reordered once by ``torch.ops.mkldnn._reorder_linear_weight``;
* ``mkl packed``     -- float32 only: ``torch.ops.mkl._mkl_linear`` on an MKL-packed
  weight (packed for one batch size; it still accepts others).

Random weights (the timings do not depend on the values). Reports the median of
``--repeats`` sweeps, in CPU time of this process (``time.process_time``, which does
not count waiting for a core on a shared machine) and wall clock, and the load average.

    OMP_NUM_THREADS=1 python benchmarks/cpu_linear_microbench.py --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

LAYERS = 30
HIDDEN = 576
# vLLM's merged projections of SmolLM2-135M (LlamaForCausalLM): (out, in) per layer.
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * 1536, HIDDEN), (HIDDEN, 1536)]
LM_HEAD = (49152, HIDDEN)


def weights(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    return [(torch.randn(s, generator=gen) * 0.02).to(dtype) for s in shapes]


Linear = Callable[[torch.Tensor], torch.Tensor]


def variants(ws: list[torch.Tensor], dtype: torch.dtype) -> dict[str, list[Linear]]:
    out: dict[str, list[Linear]] = {
        "F.linear": [lambda x, w=w: F.linear(x, w) for w in ws],
        "W @ x.T": [lambda x, w=w: (w @ x.T).T.contiguous() for w in ws],
    }
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        out["mkldnn packed"] = [
            lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            for p in packed
        ]
    except (RuntimeError, AttributeError) as exc:
        print(f"# mkldnn packed unavailable for {dtype}: {exc}".splitlines()[0])
    if dtype == torch.float32:
        try:
            mkl = [(torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w) for w in ws]
            out["mkl packed"] = [
                lambda x, p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, 1)
                for p, w in mkl
            ]
        except (RuntimeError, AttributeError) as exc:
            print(f"# mkl packed unavailable: {exc}".splitlines()[0])
    return out


def sweep(fns: list[Linear], xs: list[torch.Tensor]) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    for fn, x in zip(fns, xs):
        fn(x)
    return time.process_time() - c0, time.perf_counter() - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,9,16,24")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"# torch {torch.__version__}, {args.threads} thread(s), load {os.getloadavg()}")
    print("| dtype | variant | " + " | ".join(f"{r} rows" for r in rows) + " |  (CPU ms, median)")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ws = weights(dtype)
        for vname, fns in variants(ws, dtype).items():
            cells = []
            for r in rows:
                inputs = {k: torch.randn(r, k).to(dtype) for k in {w.shape[1] for w in ws}}
                x = [inputs[w.shape[1]] for w in ws]
                try:
                    sweep(fns, x)  # warm-up (oneDNN primitive creation)
                except RuntimeError as exc:
                    cells.append(None)
                    print(f"# {name} {vname} {r} rows failed: {str(exc).splitlines()[0]}")
                    continue
                cpu, wall = zip(*(sweep(fns, x) for _ in range(args.repeats)))
                cells.append(statistics.median(cpu) * 1e3)
                results.append({"dtype": name, "variant": vname, "rows": r,
                                "cpu_ms": statistics.median(cpu) * 1e3,
                                "wall_ms": statistics.median(wall) * 1e3})
            print(f"| {name} | {vname} | "
                  + " | ".join("–" if c is None else f"{c:.1f}" for c in cells) + " |",
                  flush=True)
    print(f"# load after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"threads": args.threads, "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
