"""``vllm-specx distill`` end to end on the fixture pair with a tiny budget (one real vLLM
engine generates the data, one serves the drafter), resumable stages, determinism for a seed,
and the refusals of bad input before anything starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli_output import without_logging_errors
from vllm_specx.cli import main as specx_main
from vllm_specx.fixtures import fixture_model_dirs
from vllm_specx.training.distill import (
    DRAFT_SIZES,
    block_efficiency,
    parse_draft_size,
    split_prompts,
)

CORPUS = Path(__file__).resolve().parents[2] / "vllm_specx" / "training"  # real text, offline
PROMPTS = [
    "def parse_args(argv):\n    parser = ",
    {"prompt": "class Node:\n    def __init__(self, value):\n"},
    "import os\n\ndef walk(path):\n",
    {"prompt": "    for key, value in sorted(items.items()):\n"},
    "def __repr__(self):\n        return ",
    "with open(path, encoding=\"utf-8\") as f:\n    ",
]


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _argv(prompts: Path, out: Path, *extra: str) -> list[str]:
    target, _ = fixture_model_dirs()
    return ["distill", "--target", str(target), "--draft-config", "tiny", "--prompts",
            str(prompts), "-o", str(out), "--max-tokens", "10", "--seq-len", "64",
            "--pretrain-steps", "3", "--pretrain-batch", "4", "--finetune-steps", "3",
            "--finetune-batch", "4", "--heldout-fraction", "0.34", "--seed", "7",
            "--no-progress", *extra]


@pytest.mark.engine
def test_distill_end_to_end_resumes_and_is_deterministic(tmp_path, monkeypatch, capsys):
    from safetensors import safe_open
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_specx.engine import running_llm

    prompts, out = _prompts(tmp_path), tmp_path / "draft"
    argv = _argv(prompts, out, "--corpus", str(CORPUS), "--save-dtype", "bfloat16")
    assert specx_main(argv) == 0
    target, _ = fixture_model_dirs()
    t_cfg = json.loads((target / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    # The target's vocabulary and token ids, the requested shape, tied embeddings.
    assert cfg["vocab_size"] == t_cfg["vocab_size"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (t_cfg["bos_token_id"],
                                                          t_cfg["eos_token_id"])
    tiny = DRAFT_SIZES["tiny"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (tiny.hidden, tiny.layers)
    assert cfg["tie_word_embeddings"] is True
    assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}  # noqa: SIM118

    report = json.loads((out / "REPORT.json").read_text())
    stages = report["stages"]
    # 6 prompts, 2 held out (0.34), each answered at the 4 default temperatures.
    assert stages["data"]["heldout_prompts"] == 2 and stages["data"]["train_prompts"] == 4
    assert stages["data"]["responses"] == 24
    assert stages["pretrain"]["steps"] == 3 and stages["pretrain"]["corpus_files"] >= 3
    assert stages["finetune"]["steps"] == 3
    held = report["heldout"]
    assert held["responses"] == 8 and 0 < held["positions"] <= 80
    assert 0.0 <= held["greedy_agreement"] <= 1.0 and 0.0 < held["expected_acceptance_t1"] <= 1.0
    assert set(held["expected_acceptance_t1_by_response_temperature"]) == {
        "0.0", "0.3", "0.7", "1.0"}
    assert 1.0 <= held["greedy_block_efficiency"]["k=4"] <= 5.0
    assert report["command"].startswith("vllm-specx distill --target ")
    assert report["draft"]["saved_dtype"] == "bfloat16"
    assert report["draft"]["params"] > 0 and report["draft"]["dir_bytes"] > 0

    # Resume: every stage is done, so nothing may generate or train again.
    import vllm_specx.training.data as data_mod
    import vllm_specx.training.loop as loop_mod

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    weights = (out / "model.safetensors").read_bytes()
    with monkeypatch.context() as m:
        m.setattr(data_mod, "generate_responses", must_not_run)
        m.setattr(loop_mod, "train_loop", must_not_run)
        capsys.readouterr()
        assert specx_main(argv) == 0
    log = capsys.readouterr().out
    for stage in ("data", "pretrain", "finetune", "report"):
        assert f"stage {stage} done before" in log
    assert (out / "model.safetensors").read_bytes() == weights

    # Determinism: the same data, trained again from the same seed, gives the same bytes.
    work2 = tmp_path / "work2"
    shutil.copytree(tmp_path / "draft.work", work2)
    for name in ("pretrain.done.json", "finetune.done.json"):
        (work2 / name).unlink()
    shutil.rmtree(work2 / "pretrain")
    out2 = tmp_path / "draft2"
    with monkeypatch.context() as m:
        m.setattr(data_mod, "generate_responses", must_not_run)  # the data stage is reused
        assert specx_main([*argv[:argv.index("-o")], "-o", str(out2),
                           *argv[argv.index("-o") + 2:], "--work-dir", str(work2)]) == 0
    assert (out2 / "model.safetensors").read_bytes() == weights
    report2 = json.loads((out2 / "REPORT.json").read_text())
    assert report2["heldout"] == held

    # Other training inputs: the data and pretrain stages are reused, finetune runs again.
    with monkeypatch.context() as m:
        m.setattr(data_mod, "generate_responses", must_not_run)
        capsys.readouterr()
        assert specx_main([*argv, "--finetune-steps", "4"]) == 0
    log = capsys.readouterr().out
    assert "stage data done before" in log and "stage pretrain done before" in log
    assert "finetune.done.json: inputs changed (steps): running the stage again" in log
    assert json.loads((out / "REPORT.json").read_text())["stages"]["finetune"]["steps"] == 4

    # The drafter is a draft model vLLM loads as it is (bf16 weights, fp32 engine; mtad and
    # adaptive load their drafter through the same draft-model loader): greedy speculation
    # reproduces the target's greedy answers of the held-out prompts token for token.
    import torch

    data = torch.load(tmp_path / "draft.work" / "data.pt")
    greedy = [r for r in data["heldout"] if r["temperature"] == 0.0]
    spec = {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3}
    with running_llm(target, speculative_config=spec) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in greedy],
                            SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [r["response_ids"] for r in greedy]


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--draft-config", "3x1"), "--draft-config '3x1' is not allowed"),
        (("--temperature", "-1"), "temperature=[-1.0] is not allowed"),
        (("--heldout-fraction", "1"), "heldout_fraction=1.0 is not allowed"),
        (("--finetune-steps", "0"), "--finetune-steps 0 without --corpus would train nothing"),
        (("--engine-args", "[1]"), "--engine-args '[1]': allowed: a JSON object"),
        (("--save-dtype", "int8"), "argument --save-dtype: invalid choice: 'int8'"),
        (("--corpus", "/nonexistent/corpus"), "--corpus /nonexistent/corpus: no such file"),
        (("--seq-len", "4"), "seq_len=4 is not allowed"),
        (("--init", "/nonexistent"), "not allowed with argument --draft-config"),
    ],
)
def test_bad_input_is_refused_with_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) if extra[0] in ("--save-dtype", "--init") else _no_exit():
        assert specx_main(_argv(_prompts(tmp_path), out, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(without_logging_errors(err)) == 1
    assert not out.exists() and not (tmp_path / "out.work").exists()


def test_missing_inputs_refused(tmp_path, capsys):
    argv = _argv(tmp_path / "missing.jsonl", tmp_path / "out")
    assert specx_main(argv) == 2
    assert "--prompts" in capsys.readouterr().err
    target, _ = fixture_model_dirs()
    argv = ["distill", "--target", str(target.parent), "--draft-config", "tiny", "--prompts",
            str(_prompts(tmp_path)), "-o", str(tmp_path / "out")]
    assert specx_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--target" in err and "not a model directory" in err
    assert len(without_logging_errors(err)) == 1
    with pytest.raises(SystemExit):
        specx_main(["distill", "--target", str(target), "--prompts", str(_prompts(tmp_path)),
                    "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert "one of the arguments --init --draft-config is required" in err
    assert len(without_logging_errors(err)) == 1


class _no_exit:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_draft_sizes_split_and_block_efficiency():
    assert parse_draft_size("small") == DRAFT_SIZES["small"]
    shape = parse_draft_size("192x2")
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads) == (192, 2, 3, 1)
    assert parse_draft_size("48x1").heads == 1  # narrower than one 64-wide head
    for bad in ("x2", "192", "4x1", "192x0"):
        with pytest.raises(ValueError, match="allowed"):
            parse_draft_size(bad)
    train, held = split_prompts(10, 0.2, seed=3)
    assert len(held) == 2 and not set(train) & set(held) and sorted(train + held) == list(range(10))
    assert split_prompts(10, 0.2, seed=3) == (train, held)
    assert split_prompts(2, 0.01, seed=0)[1] and split_prompts(2, 0.99, seed=0)[0]
    # Rounds: accept 2 (k cap) + 1 target token; then accept 1, fail, + 1; 5 tokens / 2 rounds.
    assert block_efficiency([True, True, False, True, False], 2) == 2.5
    assert block_efficiency([False] * 4, 4) == 1.0
    assert block_efficiency([True] * 9, 8) == 9.0


def test_the_resume_driver_runs_what_changed_and_skips_what_is_done(tmp_path):
    # The stages as plain functions of a run (no model, no engine): the driver alone.
    from vllm_specx.training.distill import (
        STAGES,
        DistillJob,
        DistillOptions,
        DistillRun,
        resume_stages,
    )

    job = DistillJob(target=tmp_path / "target", prompts=tmp_path / "p.jsonl",
                     out_dir=tmp_path / "out")
    job.work.mkdir(parents=True)
    finetune = {"lr": 1e-3}
    inputs = {"pretrain": {"steps": 0}, "data": {"train_prompts_answered": True},
              "finetune": finetune, "report": {"finetune": finetune}}
    markers = {s: job.work / f"{s}.done.json" for s in STAGES[:3]}
    markers["report"] = job.out_dir / "REPORT.json"
    logs: list[str] = []
    run = DistillRun(job, DistillOptions(), inputs, markers, tokenizer=None, bos_id=0,
                     eos_id=0, pad_id=0, progress=False, log=logs.append)
    ran: list[str] = []

    def stage_runner(stage):
        def run_stage(r):
            ran.append(stage)
            if stage == "finetune":  # the drafter's output directory, as the real stage
                r.out.mkdir(exist_ok=True)
                (r.out / "config.json").write_text("{}")
            return {"stage": stage, "steps": 1, "responses": 2}
        return run_stage

    runners = {s: stage_runner(s) for s in STAGES}
    # First run: every stage but pretrain (no corpus: 0 steps) runs once.
    assert resume_stages(run, runners=runners)["stage"] == "report"
    assert ran == ["data", "finetune", "report"]
    # Again: nothing runs, each finished stage says so.
    ran.clear()
    assert resume_stages(run, runners=runners)["stage"] == "report"
    assert ran == [] and "distill: stage data done before (2 responses), skipped" in logs
    # A changed fine-tuning input runs fine-tuning and the report again, not the data.
    finetune["lr"] = 2e-3
    assert resume_stages(run, runners=runners)["stage"] == "report"
    assert ran == ["finetune", "report"]
    # A removed output directory runs fine-tuning again; stop_after stops there.
    ran.clear()
    (job.out_dir / "config.json").unlink()
    assert resume_stages(run, stop_after="finetune", runners=runners)["stage"] == "finetune"
    assert ran == ["finetune"]
    # stop_after a stage the run skips (pretrain without a corpus): an empty record.
    assert resume_stages(run, stop_after="pretrain", runners=runners) == {}
