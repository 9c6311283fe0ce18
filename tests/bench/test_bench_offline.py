"""Configuration handling, prompt files, the markdown table, the plots and the NVML guard
(everything of the benchmark that needs no engine)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from vllm_specx.bench import configs as C
from vllm_specx.bench.energy import EnergyMeter
from vllm_specx.bench.prompts import prompts_sha256, read_jsonl
from vllm_specx.bench.report import markdown_table, write_plots

# --- configurations -------------------------------------------------------------------


def test_parse_config_strips_name():
    name, cfg = C.parse_config_arg('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"name": "my ngram"}')
    assert name == "my ngram"
    assert cfg == {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"num_speculative_tokens": 3}', "needs a \"method\""),
        ('{"method": "ngram", "name": ""}', "non-empty string"),
    ],
)
def test_parse_config_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        C.parse_config_arg(text)


@pytest.mark.parametrize(
    "cfg, gets_draft",
    [
        ({"method": "draft_model", "num_speculative_tokens": 4}, True),
        ({"method": "mtad"}, True),  # specx method on a draft model
        ({"method": "adaptive"}, True),
        ({"method": "ngram", "num_speculative_tokens": 4}, False),
        ({"method": "suffix"}, False),
        ({"method": "mtp", "num_speculative_tokens": 1}, False),
        ({"method": "deepseek_mtp"}, False),
        ({"method": "specx_mtp"}, False),
        ({"method": "draft_model", "model": "/elsewhere"}, False),
    ],
)
def test_default_draft_is_added_only_where_needed(cfg, gets_draft):
    out = C.with_default_draft(cfg, "/d")
    if gets_draft:
        assert out["model"] == "/d"
    else:
        assert out.get("model") == cfg.get("model")
    assert "model" not in cfg or cfg["model"] == out["model"]  # input untouched


def test_missing_default_draft_is_an_error():
    with pytest.raises(ValueError, match="needs a draft model"):
        C.with_default_draft({"method": "draft_model"}, None)


def test_model_free_methods():
    assert C.is_model_free({"method": "ngram"})
    assert C.is_model_free({"method": "suffix"})
    assert not C.is_model_free({"method": "draft_model", "model": "/d"})
    assert not C.is_model_free({"method": "mtad", "model": "/d"})
    assert not C.is_model_free({"method": "mtp"})  # MTP layers are a model too


def test_names():
    assert C.default_name({"method": "draft_model", "num_speculative_tokens": 4,
                           "model": "/d"}, "/d") == "draft_model k=4"
    assert C.default_name({"method": "mtad", "num_beams": 8, "acceptance_threshold": 0.1,
                           "model": "/x/other"}, "/d") == (
        "mtad acceptance_threshold=0.1 num_beams=8 model=other")
    assert C.unique_names(["a", "b", "a", "a"]) == ["a", "b", "a #2", "a #3"]


def test_default_configs_are_vllm_methods_plus_available_specx():
    from vllm_specx.methods import METHODS

    methods = [c["method"] for c in C.default_configs(3)]
    assert methods[:2] == ["ngram", "draft_model"]
    expected = {n for n, s in METHODS.items() if s.available and s.needs_draft_model
                and s.vllm_method not in ("eagle", "eagle3")}
    assert set(methods[2:]) == expected
    assert C.default_configs(3)[1]["num_speculative_tokens"] == 3
    # With a head (the real pair's shipped one): vLLM's eagle3 and specx_eagle3 on it.
    with_head = C.default_configs(1, eagle3_head="/h", eagle3_k=3)
    assert with_head[-2:] == [
        {"method": "eagle3", "model": "/h", "num_speculative_tokens": 3},
        {"method": "specx_eagle3", "model": "/h", "adaptive": True}]


def test_the_real_pair_defaults_include_a_draft_model_tree():
    """The real pair's defaults run adaptive with REAL_PAIR_TREE (a valid draft_tree, the
    i.i.d. children of sampled requests on: the default), before the EAGLE configs."""
    import argparse

    from vllm_specx.algorithms.draft_tree import validate_tree_knob
    from vllm_specx.bench.cli import _parsed_configs
    from vllm_specx.methods import draft_model_tree

    assert C.default_configs(1)[-1].get("draft_tree") is None
    args = argparse.Namespace(config=None, num_speculative_tokens=None)
    configs = [cfg for _, cfg in _parsed_configs(args, "real")]
    trees = [c for c in configs if "draft_tree" in c]
    assert trees[0] == {"method": "adaptive", "draft_tree": C.REAL_PAIR_TREE,
                        "num_speculative_tokens": 1}
    assert validate_tree_knob(C.REAL_PAIR_TREE) == []
    assert validate_tree_knob(C.REAL_PAIR_EAGLE3_TREE) == []
    assert draft_model_tree(trees[0])["sampled_children"] is True
    with_head = C.default_configs(1, eagle3_head="/h", draft_tree=C.REAL_PAIR_TREE,
                                  eagle3_tree=C.REAL_PAIR_EAGLE3_TREE)
    assert [c["method"] for c in with_head[-4:]] == [
        "adaptive", "eagle3", "specx_eagle3", "specx_eagle3"]
    assert with_head[-1] == {"method": "specx_eagle3", "model": "/h",
                             "draft_tree": C.REAL_PAIR_EAGLE3_TREE}
    # -k names every chain's K; a head's tree keeps its node budget.
    args = argparse.Namespace(config=None, num_speculative_tokens=2)
    with_k = [cfg for _, cfg in _parsed_configs(args, "real")]
    if any(c["method"] == "eagle3" for c in with_k):  # the shipped head is present
        last = with_k[-1]
        assert (last["method"], last["draft_tree"]) == ("specx_eagle3", C.REAL_PAIR_EAGLE3_TREE)
        assert "num_speculative_tokens" not in last


# --- prompts --------------------------------------------------------------------------


def test_read_jsonl_accepts_strings_and_objects(tmp_path: Path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n"b"\n{"prompt": "c", "id": 3}\n', encoding="utf-8")
    ps = read_jsonl(f)
    assert ps.prompts == ["a", "b", "c"]
    assert read_jsonl(f, limit=2).prompts == ["a", "b"]
    d = ps.describe()
    assert d["count"] == 3
    assert d["sha256"] == prompts_sha256(["a", "b", "c"])
    assert prompts_sha256(["a", "b"]) != prompts_sha256(["b", "a"])


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"}\n', "prompt"),
    ("nope\n", "not JSON"),
    ("\n", "no prompts"),
])
def test_read_jsonl_errors_name_the_line(tmp_path: Path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_jsonl(f)


# --- report ---------------------------------------------------------------------------


def _report() -> dict:
    base = {"name": "baseline", "method": "none", "num_speculative_tokens": 0,
            "generated_tokens": 16, "target_forward_passes": 16, "verification_rate": 1.0,
            "discard_rate": 0.0, "block_efficiency": 1.0, "mean_acceptance_length": 1.0,
            "acceptance_per_position": [], "padding_ratio": 0.0, "perplexity": 5.0,
            "wall_s": 1.0, "tokens_per_s": 16.0, "projected_speedup": 1.0,
            "measured_speedup": 1.0}
    spec = dict(base, name="draft_model k=2", method="draft_model", num_speculative_tokens=2,
                target_forward_passes=8, verification_rate=0.5, discard_rate=0.25,
                block_efficiency=2.0, mean_acceptance_length=2.0,
                acceptance_per_position=[0.75, 0.25], perplexity=5.5,
                projected_speedup=1.6, measured_speedup=None)
    broken = {"name": "mtad", "method": "mtad", "error": "SpecxConfigError: ..."}
    return {
        "platform": {"description": "test box", "device_type": "cpu"},
        "versions": {"vllm": "0.32.0", "vllm_specx": "0.1.0"},
        "models": {"target": "/t", "draft": "/d"},
        "prompts": {"count": 2, "source": "file:p", "sha256": "ab" * 32},
        "sampling": {"max_tokens": 8, "temperature": 1.0},
        "forward_costs": {"method": "m", "target": {"seconds": 0.01},
                          "drafts": {"/d": {"seconds": 0.002}}},
        "formulas": {"projected_speedup": "projected_speedup = ..."},
        "configs": [base, spec, broken],
    }


def test_markdown_table_has_one_row_per_config():
    md = markdown_table(_report())
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 3  # header + three configurations
    assert "draft_model k=2" in rows[2]
    assert "0.75 0.25" in rows[2]
    assert "| 2.000 |" in rows[2]  # block efficiency
    assert "–" in rows[3]  # failed config: no numbers
    assert "projected_speedup = ..." in md
    assert "CPU reference backend" in md


def _verdict_report(temperature: float, rows: list[tuple[str, str, float, float]]) -> dict:
    """A report whose configurations are (name, method, wall speed-up, matches_baseline)."""
    base = {"name": "baseline", "method": "none", "tokens_per_s": 10.0,
            "measured_speedup": 1.0, "matches_baseline": None}
    configs = [base] + [{"name": n, "method": m, "tokens_per_s": 10.0 * s,
                         "measured_speedup": s, "matches_baseline": match}
                        for n, m, s, match in rows]
    return {"sampling": {"temperature": temperature}, "configs": configs}


def test_verdict_names_fastest_fastest_lossless_and_greedy_match():
    from vllm_specx.bench.report import verdict

    line = verdict(_verdict_report(0.0, [("draft K=1", "draft_model", 1.1, 1.0),
                                         ("mtad B=2", "mtad", 1.3, 0.5),
                                         ("adaptive", "adaptive", 1.2, 1.0)]))
    assert "\n" not in line
    assert "fastest: mtad B=2 at 1.30x wall clock vs no speculation (10.0 tok/s without)" in line
    assert "fastest lossless: adaptive at 1.20x" in line  # mtad is not lossless
    # mtad's 0.5 does not count: only lossless methods must equal no speculation.
    assert "greedy output equals no speculation for all 2 lossless configurations" in line
    assert markdown_table({**_report(), **_verdict_report(0.0, [
        ("d", "draft_model", 1.1, 1.0)])}).splitlines()[0].startswith("**verdict:**")


def test_verdict_when_speculation_loses_or_greedy_differs():
    from vllm_specx.bench.report import verdict

    line = verdict(_verdict_report(0.0, [("draft K=1", "draft_model", 0.9, 1.0),
                                         ("ngram", "ngram", 0.8, 0.75)]))
    assert "fastest: no speculation (10.0 tok/s without); best speculative: draft K=1 at 0.90x" \
        in line
    assert "fastest lossless: the same" in line
    assert "DIFFERS from no speculation for 1 of 2 lossless configurations (ngram)" in line
    sampled = verdict(_verdict_report(1.0, [("draft K=1", "draft_model", 1.05, 0.0)]))
    assert "greedy output: not compared (sampled run" in sampled
    assert "no speculative configuration" in verdict(_verdict_report(0.0, []))


def test_plots_are_written(tmp_path: Path):
    paths = write_plots(_report(), tmp_path / "report")
    assert [p.name for p in paths] == [
        "report_acceptance.png",
        "report_speedup_vs_block_efficiency.png",
        "report_perplexity_vs_speedup.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- energy ---------------------------------------------------------------------------


def _fake_pynvml(readings: list[int], fail_init: bool = False) -> types.ModuleType:
    mod = types.ModuleType("pynvml")

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    mod.nvmlDeviceGetName = lambda h: b"Fake H100"
    it = iter(readings)
    mod.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(it)
    return mod


def test_energy_meter_reads_nvml_millijoules(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([1_000, 251_000]))
    meter = EnergyMeter(index=0)
    assert meter.available and meter.device_name == "Fake H100"
    meter.start()
    assert meter.stop() == pytest.approx(250.0)
    meter.close()


def test_energy_meter_without_gpu_gives_none(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([], fail_init=True))
    meter = EnergyMeter()
    assert not meter.available
    meter.start()
    assert meter.stop() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    meter = EnergyMeter()
    meter.start()
    assert meter.stop() is None


# --- command line (no engine) ---------------------------------------------------------


def test_bench_is_a_subcommand_with_help_on_every_option():
    from vllm_specx.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = sub.choices["bench"]
    options = [a for a in bench._actions if a.option_strings and a.dest != "help"]
    assert {"output", "config", "prompts", "max_tokens", "temperature", "target", "draft",
            "num_prompts", "top_k", "top_p", "seed"} <= {a.dest for a in options}
    assert all(a.help for a in options)


@pytest.mark.parametrize("argv, message", [
    (["--config", "{oops"], "not JSON"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--engine-args", "[1]"], "JSON object"),
])
def test_bad_arguments_exit_2_before_any_engine(argv, message, capsys):
    from vllm_specx.cli import main

    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_report_json_roundtrip_renders(tmp_path: Path):
    # A saved report can be re-rendered: the table works on the parsed JSON.
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report()))
    assert markdown_table(json.loads(path.read_text())) == markdown_table(_report())
