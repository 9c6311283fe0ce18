"""Presenting a benchmark report: the markdown table and the PNG plots.

Works on the report dict alone (the JSON written to disk), so a saved report can be
re-rendered without running anything.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

PLOT_SUFFIXES = {
    "acceptance": "_acceptance.png",
    "speedup_vs_block_efficiency": "_speedup_vs_block_efficiency.png",
    "perplexity_vs_speedup": "_perplexity_vs_speedup.png",
}


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}f}"
    return str(value)


TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    # (header, key, digits)
    ("config", "name", 0),
    ("method", "method", 0),
    ("K", "num_speculative_tokens", 0),
    ("tokens", "generated_tokens", 0),
    ("target fwd", "target_forward_passes", 0),
    ("verif. rate", "verification_rate", 3),
    ("discard rate", "discard_rate", 3),
    ("block eff.", "block_efficiency", 3),
    ("mean acc. len", "mean_acceptance_length", 3),
    ("padding", "padding_ratio", 3),
    ("mean draft len", "mean_draft_length", 2),
    ("perplexity", "perplexity", 2),
    ("wall s", "wall_s", 2),
    ("tok/s", "tokens_per_s", 1),
    ("proj. speed-up", "projected_speedup", 3),
    ("oracle proj. speed-up", "oracle_projected_speedup", 3),
    ("model-time speed-up", "model_time_speedup", 3),
    ("wall speed-up", "measured_speedup", 3),
    ("tok/CPU-s", "tokens_per_cpu_s", 1),
    ("CPU-time speed-up", "cpu_speedup", 3),
)


def is_lossless(cfg: dict[str, Any]) -> bool:
    """Whether a configuration's method preserves the target's distribution: the report's
    own ``lossless`` field, else the specx method registry; vLLM's own methods verify by
    standard rejection sampling."""
    if isinstance(cfg.get("lossless"), bool):
        return bool(cfg["lossless"])
    from vllm_specx.methods import METHODS

    spec = METHODS.get(str(cfg.get("method")))
    return True if spec is None else bool(spec.lossless)


def _speedup_phrase(cfg: dict[str, Any]) -> str:
    return f"{cfg['name']} at {cfg['measured_speedup']:.2f}x"


def verdict(report: dict[str, Any]) -> str:
    """One line that answers "should I speculate here?": the fastest configuration by wall
    clock and its speed-up over no speculation, the fastest lossless one, and whether
    greedy outputs equalled no speculation's."""
    configs = report.get("configs", [])
    base = next((c for c in configs if c.get("method") == "none"), None)
    spec = [c for c in configs if c.get("method") not in (None, "none") and "error" not in c
            and _num(c.get("measured_speedup")) is not None]
    if not spec:
        return "**verdict:** no speculative configuration finished with a wall-clock time"
    fastest = max(spec, key=lambda c: c["measured_speedup"])
    baseline = report.get("baseline") or {}
    base_tps = _num(baseline.get("tokens_per_s"))
    if base_tps is None:
        base_tps = _num((base or {}).get("tokens_per_s"))
    base_text = f" ({base_tps:.1f} tok/s without)" if base_tps is not None else ""
    if fastest["measured_speedup"] > 1.0:
        first = f"fastest: {_speedup_phrase(fastest)} wall clock vs no speculation{base_text}"
    else:
        first = (f"fastest: no speculation{base_text}; best speculative: "
                 f"{_speedup_phrase(fastest)}")
    lossless = [c for c in spec if is_lossless(c)]
    best_lossless = max(lossless, key=lambda c: c["measured_speedup"]) if lossless else None
    if best_lossless is None:
        second = "fastest lossless: none ran"
    elif best_lossless is fastest:
        second = "fastest lossless: the same"
    else:
        second = f"fastest lossless: {_speedup_phrase(best_lossless)}"
    temperature = _num(report.get("sampling", {}).get("temperature"))
    if temperature is None or temperature > 0:
        third = "greedy output: not compared (sampled run; draws differ by design)"
    else:
        checked = [c for c in lossless if _num(c.get("matches_baseline")) is not None]
        differ = [c["name"] for c in checked if c["matches_baseline"] < 1.0]
        if not checked:
            third = "greedy output: not compared (no baseline outputs)"
        elif differ:
            third = (f"greedy output DIFFERS from no speculation for {len(differ)} of "
                     f"{len(checked)} lossless configurations ({', '.join(differ)})")
        else:
            third = (f"greedy output equals no speculation for all {len(checked)} lossless "
                     "configurations")
    return f"**verdict:** {first}; {second}; {third}{_measured_on(report)}"


def _measured_on(report: dict[str, Any]) -> str:
    """"; measured on <CPU class, dtype>; batch up to N; baseline ... (spread ...)" for
    the verdict: a speed-up means little without the machine class, the batch size
    (speculation that pays at batch 1 loses at batch 8: without ``--batch-sizes`` the
    batch is the engine's ``max_num_seqs``, 8 by default, not 1) and how much no
    speculation itself moved between its runs before and after the configurations."""
    parts = []
    plat = report.get("platform", {})
    engine = report.get("engine", {})
    where = plat.get("cpu_class") or (plat.get("device_name") if plat else None)
    if where:
        dtype = engine.get("dtype")
        parts.append(f"measured on {where}" + (
            f", {dtype}" if dtype and not plat.get("cpu_class") else ""))
    if engine.get("max_num_seqs") is not None:
        parts.append(f"batch up to {engine['max_num_seqs']} (max_num_seqs)")
    baseline = report.get("baseline") or {}
    runs = [r for r in baseline.get("runs", []) if _num(r.get("tokens_per_s")) is not None]
    if len(runs) > 1:
        rates = " and ".join(f"{r['tokens_per_s']:.1f}" for r in runs)
        parts.append(f"no speculation {rates} tok/s before and after the configurations "
                     f"(spread {100 * float(baseline.get('spread') or 0.0):.1f}%; "
                     "speed-ups against their mean)")
    return "".join(f"; {p}" for p in parts)


def markdown_table(report: dict[str, Any]) -> str:
    """The results as a markdown document: the one-line verdict, one row per
    configuration, then the context needed to read it (platform, models, prompts,
    costs, formula)."""
    header = [h for h, _, _ in TABLE_COLUMNS] + ["acceptance per position"]
    lines = [
        verdict(report),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
    ]
    for cfg in report.get("configs", []):
        cells = [_fmt(cfg.get(key), digits) for _, key, digits in TABLE_COLUMNS]
        per_pos = cfg.get("acceptance_per_position") or []
        cells.append(" ".join(f"{p:.2f}" for p in per_pos) if per_pos else "–")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")

    plat = report.get("platform", {})
    models = report.get("models", {})
    prompts = report.get("prompts", {})
    sampling = report.get("sampling", {})
    costs = report.get("forward_costs", {})
    versions = report.get("versions", {})
    target_cost = (costs.get("target") or {}).get("seconds")
    notes = [
        "",
        f"- platform: {plat.get('description', '?')}; vLLM {versions.get('vllm')}, "
        f"vllm-specx {versions.get('vllm_specx')}; dtype "
        f"{report.get('engine', {}).get('dtype', '?')}; {report.get('date', '')}",
        f"- target: {_model_line(models.get('target'))}; "
        f"default draft: {_model_line(models.get('draft'))}",
        f"- prompts: {prompts.get('count')} from {prompts.get('source')} "
        f"(sha256 {str(prompts.get('sha256', ''))[:12]}); max_tokens {sampling.get('max_tokens')}, "
        f"temperature {sampling.get('temperature')}, top_k {sampling.get('top_k')}, "
        f"top_p {sampling.get('top_p')}, seed {sampling.get('seed')}",
        f"- per-forward cost: target {_fmt(target_cost, 5)} s"
        + "".join(
            f"; draft of {name} {_fmt((c or {}).get('seconds'), 5)} s"
            for name, c in (costs.get("drafts") or {}).items()
        )
        + f" ({costs.get('method', '')})",
        f"- {report.get('formulas', {}).get('projected_speedup', '')}",
    ]
    baseline = report.get("baseline") or {}
    if baseline.get("runs"):
        runs = "; ".join(f"{_fmt(r.get('tokens_per_s'), 1)} tok/s {r.get('when', '')}"
                         for r in baseline["runs"])
        spread = _fmt(100 * (baseline.get("spread") or 0), 1)
        notes.append(f"- no speculation: {runs}; spread {spread}% "
                     f"({baseline.get('method', '')})")
    for cfg in report.get("configs", []):
        control = (cfg.get("drafter_stats") or {}).get("cost_control")
        if control:
            notes.append(f"- cost control of {cfg.get('name')}: {cost_control_line(control)}")
        tree = (cfg.get("drafter_stats") or {}).get("tree_cost_control")
        if tree:
            notes.append(f"- tree cost control of {cfg.get('name')}: "
                         f"{tree_cost_control_line(tree)}")
    if plat.get("device_type") == "cpu":
        notes.append(
            "- wall-clock numbers on the CPU reference backend move with the machine's load; "
            "compare configurations by the rates, the CPU-time speed-up and the projected "
            "speed-up"
        )
    return "\n".join(lines + notes) + "\n"


def cost_control_line(control: dict[str, Any]) -> str:
    """The cost model a drafter's cost control used (``glue/cost_model.py``'s
    ``describe()``) and what it decided, in one line."""
    return (
        f"{_cost_model_text(control.get('model'))}; {control.get('steps')} steps planned, "
        f"{control.get('all_zero_steps')} "
        f"drafting nothing, {control.get('partial_zero_steps')} drafting for some requests "
        f"only"
        + (f", {control['probes']} probes (one token for a request idle for its probe "
           "interval)" if control.get("probes") else "")
        + f"; pooled acceptance per position {control.get('pooled_acceptance')}"
        + (f"; request-rounds per depth {control['depth_histogram']}"
           if control.get("depth_histogram") else "")
        + _retired_text(control.get("idle_first_pass"))
        + _calibration_text(control.get("confidence_calibration"))
    )


def tree_cost_control_line(control: dict[str, Any]) -> str:
    """What a drafter's tree cost control (``glue/tree_cost.py``'s ``describe()``) kept of
    the drafted trees, and the cost model it priced them with, in one line."""
    return (
        f"kept {control.get('kept_nodes')} of {control.get('drafted_nodes')} drafted nodes "
        f"over {control.get('rounds')} rounds ({control.get('all_zero_rounds')} keeping none: "
        f"plain steps; {control.get('whole_rounds')} of sampled i.i.d. children verified whole "
        f"at a depth chosen before drafting), nodes kept per "
        f"request-round {control.get('kept_histogram')}, acceptance scale "
        f"{control.get('acceptance_scale')}"
        + _skipped_text(control.get("idle_first_pass"))
        + _retired_text(control.get("idle_first_pass"))
        + f"; {_cost_model_text(control.get('model'))}"
    )


def _skipped_text(idle: Any) -> str:
    """How many first passes a drafter skipped on steps where nobody drafted, and the
    catch-ups that wrote their draft KV later (``DraftKVHoles.as_dict``)."""
    if not isinstance(idle, dict) or not idle.get("skipped_first_passes"):
        return ""
    merged = idle.get("merged_catch_ups")
    return (f"; {idle['skipped_first_passes']} first passes skipped (depth 0), "
            f"{idle.get('catch_up_tokens')} positions caught up"
            + (f", in {merged} first passes" if merged else "")
            + f", in {idle.get('catch_up_passes')} passes of their own")


def _cost_model_text(model: Any) -> str:
    """A cost model's ``describe()`` (``MeasuredCosts``), or a fixed model's text."""
    if isinstance(model, dict):
        t, r = model.get("target_ms") or {}, model.get("round_ms") or {}
        text = (
            f"target step {_fmt(t.get('base'), 2)} ms + {_fmt(t.get('per_request'), 3)} ms "
            f"per request + {_fmt(t.get('per_draft_token'), 3)} ms per draft token verified"
            + (f" + {_fmt(t['any_verified'], 3)} ms when any is"
               if t.get("any_verified") is not None else "") + "; "
            f"round {_fmt(r.get('any_draft'), 2)} ms + {_fmt(r.get('per_pass'), 3)} ms per "
            f"lookahead pass + {_fmt(r.get('per_row'), 3)} ms per row"
            + (f", {_fmt(r['always'], 2)} ms every round (drafting or not)"
               if r.get("always") is not None else "")
            + (f", {_fmt(r['skip_debt_per_request'], 3)} ms per request to catch up a "
               "skipped first pass" if r.get("skip_debt_per_request") else "")
            + (f" (a catch-up pass: {_fmt(r['catch_up_pass'], 3)} ms fixed, not charged)"
               if r.get("catch_up_pass") else "")
            + f" ({model.get('source')}, "
            f"{model.get('target_steps_measured')} steps"
            + (f"; {model['not_positive']} intervals measured no time, not used"
               if model.get("not_positive") else "")
            + ")"
        )
    else:
        text = str(model)
    return text


def _retired_text(idle: Any) -> str:
    """How many requests stopped their draft KV upkeep (``DraftKVHoles.retired``)."""
    if not isinstance(idle, dict) or not idle.get("retired_requests"):
        return ""
    arrival = idle.get("retired_on_arrival") or 0
    batch = idle.get("retired_idle_batch") or 0
    after = idle.get("retire_idle_batch_after")
    return (f"; {idle['retired_requests']} requests retired from drafting ("
            + (f"{arrival} on arrival and {batch} with their batch, once {after} plans in "
               f"a row drafted nothing and not even a sure draft token paid; the rest "
               if arrival or batch else "")
            + f"idle for {idle.get('retire_after')} skipped steps in a row: no draft KV "
            f"upkeep after)")


def _calibration_text(calibration: Any) -> str:
    """The cost stop's acceptance per draft-confidence bin, bins with data only."""
    if not isinstance(calibration, dict):
        return ""
    edges = list(calibration.get("bin_edges") or [])
    bounds = [0.0, *edges, 1.0]
    cells = [
        f"{bounds[i]:g}-{bounds[i + 1]:g}: {p:.2f} ({n:g})"
        for i, (p, n) in enumerate(zip(calibration.get("accept_given_confidence") or [],
                                       calibration.get("tokens") or []))
        if n >= 1
    ]
    if not cells:
        return ""
    return ("; acceptance by draft confidence (bin: P, decayed token count) "
            + ", ".join(cells))


def _model_line(info: Any) -> str:
    """``path`` (model type, layers, hidden size) from the report's model summary."""
    if not isinstance(info, dict):
        return f"`{info}`" if info else "none"
    shape = ", ".join(
        f"{label} {info[key]}"
        for key, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"),
                           ("vocab_size", "vocab"))
        if key in info
    )
    kind = info.get("model_type", "")
    details = ", ".join(x for x in (kind, shape) if x)
    if info.get("weights_sha256"):
        details += f", weights sha256 {info['weights_sha256'][:12]}"
    return f"`{info.get('path')}`" + (f" ({details})" if details else "")


def plot_paths(stem: Path) -> dict[str, Path]:
    return {k: stem.with_name(stem.name + suffix) for k, suffix in PLOT_SUFFIXES.items()}


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _label(name: str, width: int = 30) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _subtitle(report: dict[str, Any]) -> str:
    plat = report.get("platform", {})
    sampling = report.get("sampling", {})
    text = (
        f"{plat.get('device_type', '?')}: {plat.get('device_name', '?')} · "
        f"{report.get('prompts', {}).get('count')} prompts × {sampling.get('max_tokens')} "
        f"tokens · temperature {sampling.get('temperature')}"
    )
    return "\n".join(textwrap.wrap(text, 110))


def _points(configs: list[dict[str, Any]], xkey: str, ykey: str) -> list[tuple[int, str, float,
                                                                               float]]:
    """(colour index, name, x, y) of the configurations where both values are numbers; the
    colour index is the configuration's position, so a configuration keeps its colour
    across the three plots."""
    out = []
    for i, cfg in enumerate(configs):
        x, y = _num(cfg.get(xkey)), _num(cfg.get(ykey))
        if x is not None and y is not None:
            out.append((i, str(cfg.get("name")), x, y))
    return out


def _scatter(ax: Any, points: list[tuple[int, str, float, float]], *, marker: str = "o",
             annotate: bool = True, label: bool = True) -> None:
    if not points:
        return
    xs = [p[2] for p in points]
    mid = (min(xs) + max(xs)) / 2
    for k, (i, name, x, y) in enumerate(points):
        ax.scatter([x], [y], s=70, marker=marker, color=f"C{i % 10}", zorder=3,
                   label=name if label else None)
        if annotate:
            # Points of the right half are labelled to their left, and labels alternate
            # above/below, so that neighbours (e.g. equal perplexities) stay readable.
            right = x > mid and len(points) > 1
            below = k % 2 == 1
            ax.annotate(_label(name), (x, y), textcoords="offset points",
                        xytext=(-7 if right else 7, -12 if below else 6),
                        ha="right" if right else "left", fontsize=8, color=f"C{i % 10}")


def _finish(fig: Any, ax: Any, path: Path, extra_handles: list[Any] | None = None) -> None:
    handles, labels = ax.get_legend_handles_labels()
    for h in extra_handles or []:
        handles.append(h)
        labels.append(h.get_label())
    if handles:
        # Below the axes: long configuration names must not cover the data.
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=2 if len(labels) > 3 else 1, fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def write_plots(report: dict[str, Any], stem: Path) -> list[Path]:
    """Three PNGs next to the report; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    configs = report.get("configs", [])
    paths = plot_paths(stem)
    subtitle = _subtitle(report)

    # 1. acceptance rate per draft position
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = 0
    for i, cfg in enumerate(configs):
        rates = cfg.get("acceptance_per_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", color=f"C{i % 10}",
                    label=str(cfg.get("name")))
            drawn += 1
    ax.set_title("Acceptance rate per draft position\n" + subtitle, fontsize=10)
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("P(accepted | drafted at this position)")
    ax.set_ylim(-0.03, 1.03)
    if drawn:
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, "no speculative configuration drafted", ha="center",
                transform=ax.transAxes)
    _finish(fig, ax, paths["acceptance"])
    plt.close(fig)

    # 2. speed-up vs block efficiency: projected (dots) and measured wall clock (crosses)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    _scatter(ax, _points(configs, "block_efficiency", "projected_speedup"))
    _scatter(ax, _points(configs, "block_efficiency", "model_time_speedup"), marker="^",
             annotate=False, label=False)
    _scatter(ax, _points(configs, "block_efficiency", "measured_speedup"), marker="x",
             annotate=False, label=False)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_title("Speed-up over no speculation vs block efficiency\n" + subtitle, fontsize=10)
    ax.set_xlabel("block efficiency (generated tokens per target forward)")
    ax.set_ylabel("speed-up (×)")
    _finish(fig, ax, paths["speedup_vs_block_efficiency"], extra_handles=[
        Line2D([], [], marker="o", ls="", color="black", label="projected (SpecDec++ eq. 2.3)"),
        Line2D([], [], marker="^", ls="", color="black",
               label="measured model time (forwards only)"),
        Line2D([], [], marker="x", ls="", color="black", label="measured wall clock"),
        Line2D([], [], ls="--", color="grey", label="no speed-up"),
    ])
    plt.close(fig)

    # 3. perplexity vs projected speed-up
    fig, ax = plt.subplots(figsize=(8, 4.8))
    pts = _points(configs, "projected_speedup", "perplexity")
    _scatter(ax, pts)
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    if pts:
        lo, hi = min(p[3] for p in pts), max(p[3] for p in pts)
        pad = max((hi - lo) * 0.15, abs(hi) * 0.01, 1e-3)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_title("Perplexity of the generated text under the target vs projected speed-up\n"
                 + subtitle, fontsize=10)
    ax.set_xlabel("projected speed-up (×)")
    ax.set_ylabel("perplexity (lower is better)")
    _finish(fig, ax, paths["perplexity_vs_speedup"])
    plt.close(fig)
    return list(paths.values())
