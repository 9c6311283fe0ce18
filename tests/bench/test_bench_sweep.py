"""``vllm-specx bench --batch-sizes``: the sweep's pure parts (bench/sweep.py) on a
synthetic pair of per-batch reports, and its argument checks through the CLI (one line,
exit status 2, before any engine). The engine side is the ordinary benchmark, run once per
batch size (tests/bench/test_bench_engine.py covers it)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from vllm_specx.bench.prompts import PromptSet
from vllm_specx.bench.sweep import (
    OFF_SUFFIX,
    cost_control_applies,
    parse_batch_sizes,
    prompts_for_batch,
    sweep_rows,
    sweep_table,
    with_control_twins,
    write_sweep_csv,
    write_sweep_plot,
)


def test_parse_batch_sizes():
    assert parse_batch_sizes("8,1,32,8") == [1, 8, 32]
    for bad in ("", "0,8", "a,b", "-1"):
        with pytest.raises(ValueError, match="positive integers"):
            parse_batch_sizes(bad)


def test_twins_only_where_cost_control_applies():
    named = [
        ("adaptive", {"method": "adaptive"}),
        ("adaptive tree", {"method": "adaptive", "draft_tree": True}),
        ("adaptive fixed", {"method": "adaptive", "cost_control": False}),
        ("eagle3 adaptive", {"method": "specx_eagle3", "adaptive": True}),
        ("eagle3 K", {"method": "specx_eagle3"}),
        ("mtad", {"method": "mtad"}),  # its depth control is on ("greedy") by default
        ("mtad cc", {"method": "mtad", "cost_control": True}),
        ("mtad tree", {"method": "mtad", "draft_tree": True}),
        ("mtad fixed", {"method": "mtad", "cost_control": False}),
        ("draft_model", {"method": "draft_model"}),
        # Dynamic trees: pruned unless cost_control is false; a static paths tree never.
        ("eagle3 tree", {"method": "specx_eagle3", "draft_tree": True}),
        ("eagle3 tree cc", {"method": "specx_eagle3", "draft_tree": True, "cost_control": True}),
        ("eagle3 tree whole", {"method": "specx_eagle3", "draft_tree": True,
                               "cost_control": False}),
        ("eagle3 paths cc", {"method": "specx_eagle3", "draft_tree": {"paths": [[0]]},
                             "cost_control": True}),
    ]
    out = with_control_twins(named)
    twins = [(n, c) for n, c in out if n.endswith(OFF_SUFFIX)]
    assert [n for n, _ in twins] == [
        "adaptive" + OFF_SUFFIX, "adaptive tree" + OFF_SUFFIX, "eagle3 adaptive" + OFF_SUFFIX,
        "mtad" + OFF_SUFFIX, "mtad cc" + OFF_SUFFIX, "mtad tree" + OFF_SUFFIX,
        "eagle3 tree" + OFF_SUFFIX, "eagle3 tree cc" + OFF_SUFFIX]
    assert all(c["cost_control"] is False for _, c in twins)
    assert not any(cost_control_applies(c) for _, c in twins)
    assert len(out) == len(named) + 8


def test_prompts_fill_the_batch():
    ps = PromptSet(["a", "b", "c"], "x")
    assert prompts_for_batch(ps, 2) is ps
    assert prompts_for_batch(ps, 8).prompts == ["a", "b", "c"] * 2 + ["a", "b"]


def _report(batch: int, on: float, off: float) -> dict:
    def row(name, spec, speedup, control=None):
        stats = {"cost_control": control} if control else {}
        return {"name": name, "speculative_config": spec, "measured_speedup": speedup,
                "cpu_speedup": speedup + 0.01, "block_efficiency": 1.2,
                "drafter_stats": stats}

    return {
        "baseline": {"tokens_per_s": 10.0 * batch},
        "platform": {"device_type": "cpu"}, "sampling": {"temperature": 0},
        "prompts": {"count": batch},
        "configs": [
            {"name": "baseline", "speculative_config": None},
            row("adaptive", {"method": "adaptive"}, on,
                {"steps": 10, "all_zero_steps": 7,
                 "idle_first_pass": {"skipped_first_passes": 6, "retired_requests": 2}}),
            row("adaptive" + OFF_SUFFIX, {"method": "adaptive", "cost_control": False}, off),
            row("draft_model K=1", {"method": "draft_model"}, 0.9),
        ],
    }


def test_rows_table_csv_and_plot(tmp_path: Path):
    rows = sweep_rows({8: _report(8, 0.98, 0.7), 1: _report(1, 1.05, 1.1)})
    assert [(r["batch_size"], r["base_name"], r["cost_control"]) for r in rows] == [
        (1, "adaptive", "on"), (1, "adaptive", "off"), (1, "draft_model K=1", "n/a"),
        (8, "adaptive", "on"), (8, "adaptive", "off"), (8, "draft_model K=1", "n/a")]
    assert rows[3]["measured_speedup"] == 0.98 and rows[4]["measured_speedup"] == 0.7
    assert rows[3]["skipped_first_passes"] == 6 and rows[3]["retired_requests"] == 2
    table = sweep_table(rows)
    assert "| 8 | adaptive | on | 0.980 | 0.990 | 1.200 | 7 of 10 |" in table
    stem = tmp_path / "report"
    with write_sweep_csv(rows, stem).open(encoding="utf-8") as fh:
        read = list(csv.DictReader(fh))
    assert [(r["batch_size"], r["cost_control"], r["measured_speedup"]) for r in read][3:5] == [
        ("8", "on", "0.98"), ("8", "off", "0.7")]
    png = write_sweep_plot(rows, stem, "cpu")
    assert png.name == "report_batch_sweep.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_refuses_bad_sweep_arguments(capsys):
    from vllm_specx.cli import main

    assert main(["bench", "--pair", "fixture", "--batch-sizes", "0,8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["vllm-specx bench: error: --batch-sizes '0,8': expected positive "
                   "integers separated by commas, e.g. 1,8,32"]
    assert main(["bench", "--pair", "fixture", "--batch-sizes", "1,8",
                 "--engine-args", '{"max_num_seqs": 4}']) == 2
    assert "leave it out of --engine-args" in capsys.readouterr().err
