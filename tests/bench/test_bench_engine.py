"""``vllm-specx bench`` end to end on the real engine: tiny random models, 2 prompts x 8
tokens, baseline + ngram + draft_model + baseline again (4 engine starts). One run per
module; the tests read its outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

K = 3
MAX_TOKENS = 8
NGRAM = f"ngram k={K} prompt_lookup_max=3 prompt_lookup_min=1"
# Prompts that repeat themselves, so ngram finds matches and proposes drafts.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n",
]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory):
    from vllm_specx.cli import main
    from vllm_specx.testing.tiny_models import target_and_draft

    root = tmp_path_factory.mktemp("bench")
    pair = target_and_draft(root / "models")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = root / "out" / "report.json"
    rc = main([
        "bench",
        "--target", str(pair.target),
        "--draft", str(pair.draft),
        "--prompts", str(prompts),
        "--max-tokens", str(MAX_TOKENS),
        "--temperature", "0",
        "--config", json.dumps({"method": "ngram", "num_speculative_tokens": K,
                                "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
        "--config", json.dumps({"method": "draft_model", "num_speculative_tokens": K,
                                "name": "draft K=3"}),
        "--output", str(out),
    ])
    return rc, out, json.loads(out.read_text()), pair


def _config(report: dict, name: str) -> dict:
    return next(c for c in report["configs"] if c["name"] == name)


REQUIRED_KEYS = {
    "name": str, "method": str, "generated_tokens": int, "target_forward_passes": int,
    "verification_rate": float, "discard_rate": float, "block_efficiency": float,
    "mean_acceptance_length": float, "acceptance_per_position": list,
    "padding_ratio": float, "perplexity": float, "wall_s": float, "tokens_per_s": float,
    "projected_speedup": float, "platform": str,
}


def test_exit_code_and_every_key(bench_run):
    rc, _, report, _ = bench_run
    assert rc == 0
    assert [c["name"] for c in report["configs"]] == [
        "baseline", NGRAM, "draft K=3", "baseline (after)"]
    for cfg in report["configs"]:
        assert "error" not in cfg
        for key, typ in REQUIRED_KEYS.items():
            value = cfg[key]
            ok = isinstance(value, typ) or (typ is float and isinstance(value, int))
            assert ok, f"{cfg['name']}: {key} = {value!r}"
        assert cfg["generated_tokens"] == len(PROMPTS) * MAX_TOKENS
        assert math.isfinite(cfg["perplexity"]) and cfg["perplexity"] >= 1.0
        assert cfg["energy_per_token_j"] is None  # no GPU here
        assert cfg["warnings"] == []  # traces agree with vLLM's own counters


def test_cpu_time_throughput(bench_run):
    # In-process engines: the CPU seconds of the generation are counted and turned into
    # tokens per CPU second and a speed-up against the baseline's (the mean of its runs).
    _, _, report, _ = bench_run
    before, after = report["configs"][0], report["configs"][-1]
    mean = (before["tokens_per_cpu_s"] + after["tokens_per_cpu_s"]) / 2
    assert report["baseline"]["tokens_per_cpu_s"] == pytest.approx(mean)
    for cfg in report["configs"]:
        assert cfg["cpu_s"] > 0
        assert cfg["tokens_per_cpu_s"] == pytest.approx(cfg["generated_tokens"] / cfg["cpu_s"])
        assert cfg["cpu_speedup"] == pytest.approx(cfg["tokens_per_cpu_s"] / mean)


def test_baseline_is_measured_before_and_after_with_its_spread(bench_run):
    # Order cannot favour a row: no speculation runs first and last, every speed-up is
    # against the mean of the two, and the spread between them is reported and printed.
    _, out, report, _ = bench_run
    before, after = report["configs"][0], report["configs"][-1]
    assert before["method"] == after["method"] == "none"
    assert after["generated_tokens"] == before["generated_tokens"]
    assert after["matches_baseline"] == 1.0  # greedy: the same tokens both times
    runs = report["baseline"]["runs"]
    assert [r["tokens_per_s"] for r in runs] == pytest.approx(
        [before["tokens_per_s"], after["tokens_per_s"]])
    mean = sum(r["tokens_per_s"] for r in runs) / 2
    assert report["baseline"]["tokens_per_s"] == pytest.approx(mean)
    assert report["baseline"]["spread"] == pytest.approx(
        abs(runs[0]["tokens_per_s"] - runs[1]["tokens_per_s"]) / mean)
    for cfg in report["configs"]:
        assert cfg["measured_speedup"] == pytest.approx(cfg["tokens_per_s"] / mean)
    verdict_line = out.with_name("report.md").read_text().splitlines()[0]
    assert f"spread {100 * report['baseline']['spread']:.1f}%" in verdict_line
    for r in runs:
        assert f"{r['tokens_per_s']:.1f}" in verdict_line


def test_warm_up_is_not_counted(bench_run):
    # Every engine generated a warm-up (every prompt, min(16, max_tokens) tokens) before
    # its timed run: none of it is in the traces, the timed step counts or vLLM's
    # counters over the timed interval.
    _, _, report, _ = bench_run
    for cfg in report["configs"]:
        assert cfg["generated_tokens"] == len(PROMPTS) * MAX_TOKENS
        assert cfg["vllm_counters"]["generation_tokens"] == len(PROMPTS) * MAX_TOKENS
    # The baseline decodes one token per request per step: its timed target forwards
    # are one per decode step, plus prefill (a counted warm-up would add 8 more).
    assert report["configs"][0]["forward_timing"]["target"]["calls"] <= (
        MAX_TOKENS + len(PROMPTS))


def test_the_verdict_names_the_cpu_class_and_dtype(bench_run):
    from vllm_specx.cpu_host import CPU_CLASSES, describe

    _, out, report, _ = bench_run
    dtype = report["engine"]["dtype"]
    assert report["platform"]["cpu_class"] == describe(dtype)
    assert report["platform"]["cpu_class"].split(" ")[0] in CPU_CLASSES
    verdict_line = out.with_name("report.md").read_text().splitlines()[0]
    assert f"measured on {describe(dtype)}" in verdict_line
    # The batch the numbers are for: the engine's max_num_seqs without --batch-sizes.
    assert f"batch up to {report['engine']['max_num_seqs']} (max_num_seqs)" in verdict_line


def test_top_level_provenance(bench_run):
    _, _, report, pair = bench_run
    import vllm

    from vllm_specx.cpu_ops.drift import release_key

    # Follows the installed release (0.32.0 in the README's set-up, 0.33.0 under
    # scripts/test_vllm033.sh).
    assert report["versions"]["vllm"] == vllm.__version__
    assert report["versions"]["vllm_specx"]
    assert report["platform"]["device_type"] == "cpu"
    # The drift-table entry the reference ops were registered from: the installed release.
    assert report["platform"]["cpu_reference_ops"] == release_key(vllm.__version__)
    assert report["models"]["target"]["path"] == str(pair.target)
    assert report["prompts"]["count"] == len(PROMPTS)
    assert len(report["prompts"]["sha256"]) == 64
    assert report["sampling"]["temperature"] == 0.0
    assert report["sampling"]["max_tokens"] == MAX_TOKENS
    assert report["seeds"]["request_seed_base"] == 0
    costs = report["forward_costs"]
    # Timed by the forward hooks: the baseline decodes both prompts together, one token each.
    assert costs["target"]["source"] == "forward timers"
    assert costs["target"]["seconds"] > 0
    assert costs["target"]["modal_tokens"] == len(PROMPTS)
    assert costs["drafts"]["draft K=3"]["seconds"] > 0
    assert costs["drafts"]["draft K=3"]["model"] == str(pair.draft)
    assert costs["drafts"][NGRAM]["seconds"] == 0.0
    assert "SpecDec++" in report["formulas"]["projected_speedup"]


def test_baseline_row(bench_run):
    _, _, report, _ = bench_run
    base = _config(report, "baseline")
    assert base["method"] == "none"
    assert base["verification_rate"] == 1.0
    assert base["block_efficiency"] == 1.0
    assert base["discard_rate"] == 0.0
    assert base["projected_speedup"] == 1.0
    assert base["acceptance_per_position"] == []
    assert base["target_forward_passes"] == len(PROMPTS) * MAX_TOKENS


def test_draft_model_row_is_consistent(bench_run):
    _, _, report, pair = bench_run
    dm = _config(report, "draft K=3")
    assert dm["method"] == "draft_model"
    assert dm["num_speculative_tokens"] == K
    assert dm["draft_model"] == str(pair.draft)
    n, n_t = dm["generated_tokens"], dm["target_forward_passes"]
    # A draft model proposes K tokens at every decode step.
    assert dm["drafted_tokens"] == K * (n_t - len(PROMPTS))
    assert dm["vllm_counters"]["spec_decode_num_draft_tokens"] == dm["drafted_tokens"]
    assert dm["verification_rate"] == pytest.approx(n_t / n)
    assert dm["block_efficiency"] == pytest.approx(n / n_t)
    assert dm["discard_rate"] == pytest.approx((dm["drafted_tokens"] - (n - n_t)) / n)
    assert len(dm["acceptance_per_position"]) == K
    assert all(0.0 <= r <= 1.0 for r in dm["acceptance_per_position"])
    assert dm["padding_ratio"] == 0.0
    assert dm["t_draft_s"] == report["forward_costs"]["drafts"]["draft K=3"]["seconds"]
    timing = dm["forward_timing"]
    # The requests decode together: each engine step is one batched target forward, and
    # the drafter runs K batched forwards per round; there are at least as many rounds as
    # the longest request's decode steps, so at least the mean of them.
    rounds = math.ceil((n_t - len(PROMPTS)) / len(PROMPTS))
    assert timing["target"]["calls"] >= rounds
    assert timing["draft"]["calls"] >= K * rounds
    assert dm["model_time_speedup"] > 0
    # The hooks count K draft forwards per drafting round: the same N_draft as vLLM's
    # drafted-token count.
    assert timing["draft"]["calls"] == K * timing["draft"]["rounds"]
    assert dm["draft_forward_passes"] == dm["drafted_tokens"]
    c = dm["t_draft_s"] / dm["t_target_s"]
    expected = 1 / (dm["verification_rate"] + c * dm["drafted_tokens"] / n)
    assert dm["projected_speedup"] == pytest.approx(expected)


def test_ngram_row(bench_run):
    _, _, report, _ = bench_run
    ng = _config(report, NGRAM)
    assert ng["forward_timing"]["draft"] is None  # nothing to time
    assert ng["t_draft_s"] == 0.0
    assert ng["verification_steps"] > 0  # the repetitive prompts gave it matches
    # No draft model: the projection is the inverse verification rate.
    assert ng["projected_speedup"] == pytest.approx(1 / ng["verification_rate"])


def test_greedy_lossless_outputs_match_the_baseline(bench_run):
    _, _, report, _ = bench_run
    base = _config(report, "baseline")
    for cfg in report["configs"][1:]:
        assert cfg["matches_baseline"] == 1.0, cfg["name"]
        assert cfg["perplexity"] == pytest.approx(base["perplexity"], rel=1e-3)


def test_markdown_and_plots_next_to_the_json(bench_run):
    _, out, report, _ = bench_run
    md = out.with_name("report.md").read_text()
    for cfg in report["configs"]:
        assert cfg["name"] in md
    for suffix in ("acceptance", "speedup_vs_block_efficiency", "perplexity_vs_speedup"):
        png = out.with_name(f"report_{suffix}.png")
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_failing_config_is_reported_and_the_rest_still_run(tmp_path: Path, bench_run):
    # Reuses the module's models; only the baseline and one broken config start engines.
    from vllm_specx.cli import main

    _, out, _, pair = bench_run
    prompts = out.parent.parent / "prompts.jsonl"
    report_path = tmp_path / "r.json"
    rc = main([
        "bench", "--target", str(pair.target), "--draft", str(pair.draft),
        "--prompts", str(prompts), "--num-prompts", "1", "--max-tokens", "2",
        "--config", '{"method": "draft_model", "num_speculative_tokens": 2, '
                    '"model": "/nonexistent/draft"}',
        "--output", str(report_path), "--no-plots",
    ])
    assert rc == 1
    report = json.loads(report_path.read_text())
    assert report["configs"][0]["name"] == "baseline"
    broken = report["configs"][1]
    assert broken["method"] == "draft_model"
    assert "nonexistent" in broken["error"]
