"""Plots of the real pair's results for the documentation site (docs/benchmarks/real-pair.md).

    python benchmarks/plot_real_pair.py [--page docs/benchmarks/real-pair.md] [--out DIR]

Reads the page's own result tables (every table whose header has ``batch``, ``T``,
``config``, ``block eff.`` and ``CPU-time speed-up``: the draft-model run and the EAGLE-3
run), so the plots show exactly the numbers the page prints, and writes two PNGs into
``--out`` (default: the page's ``img/`` folder):

* ``real-pair-speedup.png``: CPU-time speed-up over no speculation per configuration, one
  panel per (batch, temperature);
* ``real-pair-block-efficiency.png``: block efficiency (accepted drafts + 1 per target
  forward) against that speed-up, the break-even line at 1.

The tables are the source because the bench's JSON reports stay in the git-ignored
``bench-out/``; re-run the script after updating a table (each PNG carries a fingerprint
of the rows it shows, and tests/docs checks it against the page). Needs matplotlib (the
``bench`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks" / "real-pair.md"
NEEDED = ("batch", "T", "config", "block eff.", "CPU-time speed-up")
SPEEDUP_PNG = "real-pair-speedup.png"
BLOCK_PNG = "real-pair-block-efficiency.png"


@dataclass(frozen=True)
class Row:
    """One configuration of one run: the columns the plots need."""

    table: int  # which result table of the page (0: draft-model run, 1: EAGLE-3 run)
    batch: int
    temperature: float
    config: str
    block_efficiency: float
    cpu_speedup: float


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(cell: str) -> float:
    # Bold marks the headline cells (**1.12**); the value is what is inside.
    return float(cell.replace("*", ""))


def read_tables(text: str) -> list[Row]:
    """The rows of every result table in ``text`` (Markdown) with the needed columns."""
    rows: list[Row] = []
    lines = text.splitlines()
    table = -1
    i = 0
    while i < len(lines):
        header = _cells(lines[i]) if lines[i].startswith("|") else []
        if all(h in header for h in NEEDED) and i + 1 < len(lines) \
                and re.match(r"^\|[-:| ]+\|$", lines[i + 1].strip()):
            table += 1
            col = {h: header.index(h) for h in NEEDED}
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                c = _cells(lines[i])
                rows.append(Row(table, int(c[col["batch"]]), float(c[col["T"]]),
                                c[col["config"]], _number(c[col["block eff."]]),
                                _number(c[col["CPU-time speed-up"]])))
                i += 1
            continue
        i += 1
    return rows


def rows_digest(rows: list[Row]) -> str:
    """A fingerprint of the plotted numbers, stored in each PNG (its ``Description``) so
    a test can tell a plot that no longer matches the page's tables."""
    text = "\n".join(repr(r) for r in rows)
    return "real-pair tables sha256 " + hashlib.sha256(text.encode()).hexdigest()[:16]


def png_description(path: Path) -> str | None:
    """The ``Description`` text chunk of a PNG written by :func:`plot`."""
    data = path.read_bytes()
    pos = 8  # after the PNG signature
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"tEXt" and body.startswith(b"Description\0"):
            return body.split(b"\0", 1)[1].decode("latin-1")
        pos += 12 + length
    return None


def _panels(rows: list[Row]) -> list[tuple[int, float]]:
    return sorted({(r.batch, r.temperature) for r in rows})


def plot(rows: list[Row], out: Path) -> list[Path]:
    """Write the two PNGs into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    panels = _panels(rows)
    # One colour per configuration name across both plots and all panels.
    names = list(dict.fromkeys(r.config for r in rows if r.config != "baseline"))
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}

    ncols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.6 * ncols, 3.0 * nrows + 0.6),
                             sharex=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    for ax, (batch, temp) in zip(flat, panels):
        here = [r for r in rows if (r.batch, r.temperature) == (batch, temp)
                and r.config != "baseline"]
        labels = [r.config + (" (EAGLE-3 run)" if r.table else "") for r in here]
        ax.barh(range(len(here)), [r.cpu_speedup for r in here],
                color=[colour[r.config] for r in here])
        for k, r in enumerate(here):
            ax.text(r.cpu_speedup + 0.01, k, f"{r.cpu_speedup:.2f}", va="center", fontsize=7)
        ax.set_yticks(range(len(here)), labels, fontsize=7)
        ax.set_xlim(0, max(1.25, max(r.cpu_speedup for r in here) + 0.15))
        ax.invert_yaxis()
        ax.axvline(1.0, color="grey", ls="--", lw=1)
        ax.set_title(f"batch {batch}, T = {temp:g}", fontsize=10)
        ax.set_xlabel("CPU-time speed-up (x)")
        ax.tick_params(axis="x", labelbottom=True)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct on a 2-core CPU: speed-up over no speculation",
                 fontsize=11)
    fig.tight_layout()
    speedup = out / SPEEDUP_PNG
    meta = {"Description": rows_digest(rows)}
    fig.savefig(speedup, dpi=110, metadata=meta)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = {panel: m for panel, m in zip(panels, "os^Dvp")}
    for r in rows:
        if r.config == "baseline":
            continue
        ax.scatter(r.block_efficiency, r.cpu_speedup, color=colour[r.config],
                   marker=markers[(r.batch, r.temperature)], s=55, zorder=3)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", color=colour[n], label=n) for n in names]
    handles += [Line2D([], [], ls="", marker=markers[p], color="black",
                       label=f"batch {p[0]}, T = {p[1]:g}") for p in panels]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=3, frameon=False)
    ax.set_xlabel("block efficiency (generated tokens per target forward)")
    ax.set_ylabel("CPU-time speed-up (x)")
    ax.set_title("Block efficiency vs speed-up (above the dashed line: faster)", fontsize=10)
    ax.grid(alpha=0.3)
    block = out / BLOCK_PNG
    fig.savefig(block, dpi=110, bbox_inches="tight", metadata=meta)
    plt.close(fig)
    return [speedup, block]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: img/ next to the page)")
    args = parser.parse_args(argv)
    rows = read_tables(args.page.read_text(encoding="utf-8"))
    if not rows:
        raise SystemExit(f"no result table with columns {', '.join(NEEDED)} in {args.page}")
    for path in plot(rows, args.out or args.page.parent / "img"):
        print(path)


if __name__ == "__main__":
    main()
