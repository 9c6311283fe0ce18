"""The adaptive-length tables of the docs (docs/benchmarks/adaptive.md, the specx_mtp table of
docs/methods/specx-mtp.md) from `vllm-specx bench` reports.

Usage: python benchmarks/adaptive_table.py [--cost-ratio C] REPORT.json [REPORT.json ...]

Each report's rows are re-projected with ONE draft/target cost ratio for the whole report
(``--cost-ratio``, else the median of its configurations' measured t_draft / t_target), so
that configurations are compared by their counts, not by timer noise between runs on a
shared CPU; the bench's own per-configuration projection is printed beside it. The oracle column is
SpecDec++'s hindsight oracle on each configuration's own rounds (see
``vllm_specx.bench.metrics``).
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
        f"max_num_seqs {report['engine'].get('max_num_seqs')}, "
        f"{report['prompts'].get('count', '?')} prompts; draft/target cost ratio "
        f"{_fmt(ratio)} ({source})"
    )
    rows = [
        head,
        "",
        "| config | block eff. | mean draft len | discard rate | padding | proj. speed-up "
        "| oracle | bench's own proj. | tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["configs"]:
        n = c["generated_tokens"]
        vr = c["verification_rate"]
        drafting = c["method"] != "none"
        forwards = c["draft_forward_passes"]
        stats = c.get("drafter_stats") or {}
        if stats.get("requests") and "scaled" not in c["draft_forward_passes_source"]:
            # A report from before the bench scaled drafter counts to the verified rounds.
            forwards *= min(1.0, c["verification_steps"] / stats["requests"])
        proj = projected_speedup(vr, forwards / n, 1.0, ratio) if drafting else 1.0
        oracle = (
            projected_speedup(vr, c["accepted_tokens"] / n, 1.0, ratio) if drafting else None
        )
        rows.append(
            f"| {c['name']} | {_fmt(c['block_efficiency'], 2)} | "
            f"{_fmt(c.get('mean_draft_length'), 2)} | {_fmt(c['discard_rate'])} | "
            f"{_fmt(c['padding_ratio'])} | {_fmt(proj)} | {_fmt(oracle)} | "
            f"{_fmt(c['projected_speedup'])} | {_fmt(c['tokens_per_s'], 1)} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cost-ratio", type=float, default=None,
                        help="t_draft / t_target for every row (default: each report's median)")
    parser.add_argument("reports", nargs="+")
    args = parser.parse_args(argv)
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        print(f"#### {path}\n\n{table(report, args.cost_ratio)}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
