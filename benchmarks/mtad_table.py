"""The MTAD tables of the docs (docs/benchmarks/mtad.md) from `vllm-specx bench` reports.

Usage: python benchmarks/mtad_table.py [--cost-ratio C] REPORT.json [REPORT.json ...]

Each report's rows are re-projected with ONE draft/target cost ratio per draft forward
(``--cost-ratio``, else the median of the report's measured t_draft / t_target), so that
configurations are compared by their counts, not by timer noise between runs on a shared
CPU. Draft forwards are the drafter's own count (``specx_stats()``): a batched MTAD pass
over all beams of a request counts once, as on a GPU where a pass over B small beams costs
about what a pass over one does. The bench's own projection (each configuration's own
measured t_draft, which on this CPU grows with the tokens in a pass) and the wall-clock
tokens/s of the same run are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vllm_specx.bench.metrics import median_cost_ratio, projected_speedup


def _fmt(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def table(report: dict[str, Any], ratio: float | None = None) -> str:
    source = "given" if ratio is not None else "median of the measured ones"
    ratio = ratio if ratio is not None else median_cost_ratio(report["configs"])
    s = report["sampling"]
    head = (
        f"T={s.get('temperature')}, top-k {s.get('top_k')}, top-p {s.get('top_p')}, "
        f"{report['prompts'].get('count', '?')} prompts; draft/target cost ratio "
        f"{_fmt(ratio)} ({source})"
    )
    rows = [
        head,
        "",
        "| config | block eff. | verif. rate | discard rate | mean acc. len | perplexity "
        "| draft passes/round | proj. speed-up | bench's own proj. | tok/s "
        "| acceptance per position |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["configs"]:
        n = c["generated_tokens"]
        vr = c["verification_rate"]
        drafting = c["method"] != "none"
        forwards = c["draft_forward_passes"]
        proj = projected_speedup(vr, forwards / n, 1.0, ratio) if drafting else 1.0
        steps = c.get("verification_steps") or 0
        passes = forwards / steps if drafting and steps else None
        acc = " ".join(f"{a:.2f}" for a in c.get("acceptance_per_position") or []) or "–"
        rows.append(
            f"| {c['name']} | {_fmt(c['block_efficiency'], 2)} | "
            f"{_fmt(vr)} | {_fmt(c['discard_rate'])} | "
            f"{_fmt(c.get('mean_acceptance_length'), 2)} | {_fmt(c.get('perplexity'), 2)} | "
            f"{_fmt(passes, 2)} | {_fmt(proj, 2)} | {_fmt(c['projected_speedup'], 2)} | "
            f"{_fmt(c['tokens_per_s'], 1)} | {acc} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-ratio", type=float, default=None,
                        help="draft/target cost of one forward (default: the report's median)")
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args(argv)
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            print(table(json.load(f), args.cost_ratio))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
