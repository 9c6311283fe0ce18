"""``vllm-specx train-head`` end to end on the fixture pair with a tiny budget (one real vLLM
engine per run), and the refusals of bad input before anything starts."""

from __future__ import annotations

import json

import pytest

from tests.cli_output import without_logging_errors
from vllm_specx.cli import main as specx_main
from vllm_specx.fixtures import fixture_model_dirs, fixtures_root
from vllm_specx.training.data import model_summary


def _argv(prompts, out, *extra: str) -> list[str]:
    target, draft = fixture_model_dirs()
    return ["train-head", "--target", str(target), "--draft", str(draft), "--prompts",
            str(prompts), "-o", str(out), "--max-tokens", "12", "--epochs", "2",
            "--num-blocks", "2", "--batch-size", "16", "--no-progress", *extra]


@pytest.mark.engine
def test_train_head_end_to_end_is_deterministic(tmp_path):
    from vllm_specx.algorithms.acceptance_head import load_head
    from vllm_specx.config import acceptance_head_problem

    prompts = tmp_path / "prompts.jsonl"
    # Both plain forms of a prompt line; the stdlib-reference form is the shipped head's.
    prompts.write_text("\n".join([
        json.dumps("def parse_args(argv):\n    parser = "),
        json.dumps({"prompt": "class Node:\n    def __init__(self, value):\n"}),
        json.dumps("import os\n\ndef walk(path):\n"),
        json.dumps({"prompt": "    for key, value in sorted(items.items()):\n"}),
        json.dumps("def __repr__(self):\n        return "),
    ]) + "\n")
    out1, out2 = tmp_path / "h1", tmp_path / "h2"
    # Two temperatures: every prompt answered twice; one response per 5 held out.
    extra = ("--temperature", "0", "--temperature", "1", "--heldout-fraction", "0.2")
    assert specx_main(_argv(prompts, out1, *extra)) == 0
    cfg = json.loads((out1 / "config.json").read_text())
    _, draft = fixture_model_dirs()
    assert cfg["draft_model"]["weights_sha256"] == model_summary(draft)["weights_sha256"]
    assert cfg["hidden_size"] == json.loads((draft / "config.json").read_text())["hidden_size"]
    assert cfg["num_blocks"] == 2 and cfg["shared_blocks"] is False
    data = cfg["training"]["data"]
    assert data["responses"] == 10 and 0 < data["rows"] <= data["positions"] <= 120
    held = cfg["metrics"]["heldout"]
    assert held["responses"] == 2 and held["rows"] > 0 and 0.0 <= held["auc"] <= 1.0
    assert held["loss"] > 0 and 0.0 <= held["mean_label"] <= 1.0
    assert set(held["confidence_signal_auc"]) == {"token_prob", "max_prob", "top2_margin"}
    history = json.loads((out1 / "metrics.json").read_text())["history"]
    assert [e["epoch"] for e in history] == [1, 2] and "heldout_auc" in history[-1]
    head = load_head(out1)
    assert head.num_blocks == 2
    assert acceptance_head_problem(str(out1), draft_model=str(draft)) is None

    # Same seed, same machine: the same head, byte for byte.
    assert specx_main(_argv(prompts, out2, *extra)) == 0
    assert (out1 / "model.safetensors").read_bytes() == (out2 / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--mix-ratio", "1.5"), "mix_ratio=1.5 is not allowed"),
        (("--epochs", "0"), "epochs=0 is not allowed"),
        (("--temperature", "-1"), "temperature=[-1.0] is not allowed"),
        (("--engine-args", "[1]"), "--engine-args '[1]': allowed: a JSON object"),
        (("--num-prompts", "0"), "--num-prompts 0: allowed: an integer >= 1"),
    ],
)
def test_bad_input_is_refused_with_one_line(tmp_path, capsys, extra, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("def f():\n") + "\n")
    assert specx_main(_argv(prompts, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(without_logging_errors(err)) == 1
    assert not (tmp_path / "out").exists()


def test_missing_model_or_prompts_refused(tmp_path, capsys):
    argv = _argv(tmp_path / "missing.jsonl", tmp_path / "out")
    assert specx_main(argv) == 2
    assert "--prompts" in capsys.readouterr().err
    argv[argv.index("--draft") + 1] = str(fixtures_root())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\"x\"\n")
    argv[argv.index("--prompts") + 1] = str(prompts)
    assert specx_main(argv) == 2
    assert "--draft" in capsys.readouterr().err
