"""``vllm-specx bench --batch-sizes 1,8,32``: the benchmark at several batch sizes, every
configuration under cost control also with ``"cost_control": false``, and the speed-up
against batch size as a table, a CSV and a PNG (issue 32: "never slower than no
speculation" is a claim about every batch size, and the control's gain shows only beside
the same configuration without it).

Each batch size is one ordinary benchmark run (``max_num_seqs = B``, at least ``B``
prompts: the prompt set repeated if it has fewer), with its baseline measured in the same
run, so every speed-up is against no speculation at that batch size.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from vllm_specx.bench.prompts import PromptSet

# Methods whose cost control (glue/cost_model.py) is on by default (mtad's on every step;
# "greedy" narrows it to all-greedy steps); specx_mtp / specx_eagle* only with
# "adaptive": true (without it they draft K every step).
_CONTROLLED = ("adaptive", "mtad")
_CONTROLLED_WHEN_ADAPTIVE = ("specx_mtp", "specx_eagle3", "specx_eagle")
OFF_SUFFIX = " (cost_control off)"
CSV_SUFFIX = "_batch_sweep.csv"
PNG_SUFFIX = "_batch_sweep.png"
CSV_FIELDS = ("batch_size", "name", "base_name", "cost_control", "measured_speedup",
              "cpu_speedup", "block_efficiency", "baseline_tokens_per_s",
              "steps_drafting_nothing", "steps_planned", "skipped_first_passes",
              "retired_requests")


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; ValueError naming what is allowed otherwise."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"--batch-sizes {text!r}: expected positive integers separated by "
                         "commas, e.g. 1,8,32")
    return sorted(set(sizes))


def cost_control_applies(cfg: dict[str, Any]) -> bool:
    """Whether the configuration runs under cost control (its default, not turned off)."""
    if cfg.get("cost_control") is False:
        return False
    method = cfg.get("method")
    if cfg.get("draft_tree") and method in (*_CONTROLLED, *_CONTROLLED_WHEN_ADAPTIVE):
        # A dynamic tree is pruned by cost (on by default); a static paths tree never is.
        tree = cfg["draft_tree"]
        return not (isinstance(tree, dict) and "paths" in tree)
    if method in _CONTROLLED:
        return True  # a chain (its trees returned above)
    if method in _CONTROLLED_WHEN_ADAPTIVE:
        return bool(cfg.get("adaptive"))
    return False


def with_control_twins(
    named: list[tuple[str, dict[str, Any]]],
) -> list[tuple[str, dict[str, Any]]]:
    """Each configuration, followed, where cost control applies, by the same configuration
    with ``"cost_control": false``."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, cfg in named:
        out.append((name, cfg))
        if cost_control_applies(cfg):
            out.append((name + OFF_SUFFIX, {**cfg, "cost_control": False}))
    return out


def prompts_for_batch(prompts: PromptSet, batch_size: int) -> PromptSet:
    """At least ``batch_size`` prompts (the set repeated in order), so a batch fills."""
    n = len(prompts.prompts)
    if n >= batch_size or n == 0:
        return prompts
    reps = math.ceil(batch_size / n)
    return PromptSet((prompts.prompts * reps)[:batch_size],
                     f"{prompts.source} (repeated to {batch_size})")


def sweep_rows(reports: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (batch size, speculative configuration) of the per-batch reports."""
    rows = []
    for batch, report in sorted(reports.items()):
        base_rate = (report.get("baseline") or {}).get("tokens_per_s")
        for cfg in report.get("configs", []):
            spec = cfg.get("speculative_config")
            if not spec:
                continue  # the baseline rows
            name = str(cfg.get("name"))
            off = name.endswith(OFF_SUFFIX)
            control = ((cfg.get("drafter_stats") or {}).get("cost_control") or {})
            idle = control.get("idle_first_pass") or {}
            rows.append({
                "batch_size": batch,
                "name": name,
                "base_name": name[: -len(OFF_SUFFIX)] if off else name,
                "cost_control": ("off" if off else
                                 "on" if cost_control_applies(spec) else "n/a"),
                "measured_speedup": cfg.get("measured_speedup"),
                "cpu_speedup": cfg.get("cpu_speedup"),
                "block_efficiency": cfg.get("block_efficiency"),
                "baseline_tokens_per_s": base_rate,
                "steps_drafting_nothing": control.get("all_zero_steps"),
                "steps_planned": control.get("steps"),
                "skipped_first_passes": idle.get("skipped_first_passes"),
                "retired_requests": idle.get("retired_requests"),
                "error": cfg.get("error"),
            })
    return rows


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return "–" if value is None else str(value)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: speed-up (wall clock and CPU time) per configuration and batch size."""
    lines = [
        "## Speed-up against batch size (vs no speculation at the same batch size)",
        "",
        "| batch | configuration | cost control | wall speed-up | CPU-time speed-up | "
        "block eff. | steps drafting nothing |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        nothing = (f"{r['steps_drafting_nothing']} of {r['steps_planned']}"
                   if r.get("steps_planned") else "–")
        lines.append(
            f"| {r['batch_size']} | {r['base_name']} | {r['cost_control']} | "
            f"{_fmt(r['measured_speedup'])} | {_fmt(r['cpu_speedup'])} | "
            f"{_fmt(r['block_efficiency'])} | {nothing} |"
            + (f" error: {r['error']}" if r.get("error") else ""))
    return "\n".join(lines) + "\n"


def write_sweep_csv(rows: list[dict[str, Any]], stem: Path) -> Path:
    path = stem.with_name(stem.name + CSV_SUFFIX)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return path


def write_sweep_plot(rows: list[dict[str, Any]], stem: Path, subtitle: str) -> Path:
    """Two panels (wall clock, CPU time): speed-up against batch size, one colour per
    configuration, solid with cost control, dashed with ``cost_control: false``, dotted
    for configurations without it (vLLM's own, mtad)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = stem.with_name(stem.name + PNG_SUFFIX)
    bases = list(dict.fromkeys(r["base_name"] for r in rows))
    batches = sorted({r["batch_size"] for r in rows})
    style = {"on": "-", "off": "--", "n/a": ":"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
    for ax, key, title in ((axes[0], "measured_speedup", "wall clock"),
                           (axes[1], "cpu_speedup", "CPU time (tokens per CPU-second)")):
        for i, base in enumerate(bases):
            for mode in ("on", "off", "n/a"):
                pts = sorted((r["batch_size"], r[key]) for r in rows
                             if r["base_name"] == base and r["cost_control"] == mode
                             and isinstance(r.get(key), (int, float)))
                if not pts:
                    continue
                label = base + {"on": " (cost control)", "off": OFF_SUFFIX, "n/a": ""}[mode]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style[mode], marker="o",
                        color=f"C{i % 10}", label=label)
        ax.axhline(1.0, color="grey", lw=1)
        ax.axhline(0.97, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (max_num_seqs)")
        ax.set_ylabel("speed-up over no speculation (×)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.02 - 0.03 * math.ceil(len(labels) / 2)))
    fig.suptitle("Speed-up against batch size, with and without cost control (grey: 1.0x; "
                 "dotted: 0.97x)\n" + subtitle, fontsize=10, y=1.05)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
