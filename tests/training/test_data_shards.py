"""The data stage of ``distill`` / ``distill-eagle3`` at scale: the target's answers are
written in atomic shards and a killed run resumes from its last complete shard (with a fake
generator, exactly, and end to end in the real vLLM engine on the fixture target); held-out
prompts of their own (``--heldout-prompts``) stay out of training; ``--device cuda`` is
refused in one line, before anything runs, where torch sees no CUDA device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_output import without_logging_errors
from vllm_specx.cli import main as specx_main
from vllm_specx.fixtures import fixture_model_dirs
from vllm_specx.training import data as data_mod
from vllm_specx.training.data import generate_responses
from vllm_specx.training.distill import resolve_device

PROMPTS = [f"def f{i}(x):\n    return " for i in range(10)]


class Killed(Exception):
    """Stands for the process being killed between two shards."""


def _fake(calls: list[int]):
    """A generator whose answer is the request's seed, so the test sees which request got
    which seed; records the size of each call."""

    def gen(texts: list[str], params: list) -> list[tuple[list[int], list[int]]]:
        calls.append(len(texts))
        return [([len(t)], [p.seed, int(10 * p.temperature)]) for t, p in zip(texts, params)]

    return gen


def _run(folder: Path, calls: list[int], key: str = "k", on_shard=None):
    return generate_responses("unused", PROMPTS, temperatures=[0.0, 1.0], max_tokens=4,
                              seed=100, shard_dir=folder, shard_prompts=3, shard_key=key,
                              on_shard=on_shard, generator=_fake(calls))


def test_shards_resume_after_a_kill_and_equal_an_uninterrupted_run(tmp_path):
    whole_calls: list[int] = []
    whole = _run(tmp_path / "whole", whole_calls)
    # 10 prompts x 2 temperatures in shards of 3 prompts: 6, 6, 6, 2 requests.
    assert whole_calls == [6, 6, 6, 2]
    # Seeds are global (request i: seed + i), prompt-major then temperature.
    assert [r.response_ids[0] for r in whole] == list(range(100, 120))
    assert [(r.prompt_index, r.temperature) for r in whole][:3] == [(0, 0.0), (0, 1.0),
                                                                      (1, 0.0)]

    def kill_after_two(k: int, generated: bool) -> None:
        if k == 1:
            raise Killed

    folder = tmp_path / "killed"
    calls: list[int] = []
    with pytest.raises(Killed):
        _run(folder, calls, on_shard=kill_after_two)
    assert calls == [6, 6]
    assert sorted(p.name for p in folder.iterdir()) == ["shard-00000.pt", "shard-00001.pt"]
    first = (folder / "shard-00000.pt").read_bytes()
    # A half-written shard of the killed run (its temporary file) is not a shard.
    (folder / "shard-00002.pt.tmp").write_bytes(b"half a shard")
    calls = []
    generated: list[int] = []
    resumed = _run(folder, calls, on_shard=lambda k, g: generated.append(k) if g else None)
    assert calls == [6, 2] and generated == [2, 3]  # only the shards that were missing
    assert resumed == whole
    assert (folder / "shard-00000.pt").read_bytes() == first
    # A damaged shard is generated again, the others are kept.
    (folder / "shard-00001.pt").write_bytes(b"not a torch file")
    calls = []
    assert _run(folder, calls) == whole and calls == [6]
    # Other inputs (another key): every shard is generated again.
    calls = []
    _run(folder, calls, key="other")
    assert calls == [6, 6, 6, 2]


def _eagle3_argv(tmp_path: Path, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:6]))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(p) + "\n" for p in ["import os\n", "class A:\n"]))
    target, _ = fixture_model_dirs()
    return ["distill-eagle3", "--target", str(target), "--prompts", str(prompts),
            "--heldout-prompts", str(held), "-o", str(tmp_path / "head"), "--max-tokens", "8",
            "--temperature", "0", "--temperature", "1", "--data-shard-prompts", "3",
            "--stop-after", "data", "--no-progress", *extra]


@pytest.mark.engine
def test_data_stage_in_vllm_resumes_from_its_last_complete_shard(tmp_path, monkeypatch, capsys):
    saved: list[int] = []
    real_save = data_mod._save_shard

    def save_then_maybe_die(folder, k, key, rng, rows):
        real_save(folder, k, key, rng, rows)
        saved.append(k)
        if kill_after is not None and len(saved) == kill_after:
            raise Killed

    monkeypatch.setattr(data_mod, "_save_shard", save_then_maybe_die)
    kill_after: int | None = 1
    with pytest.raises(Killed):
        specx_main(_eagle3_argv(tmp_path))
    shards = tmp_path / "head.work" / "data_shards"
    assert saved == [0] and sorted(p.name for p in shards.iterdir()) == ["shard-00000.pt"]
    first = (shards / "shard-00000.pt").read_bytes()
    assert not (tmp_path / "head.work" / "data.done.json").exists()
    kill_after, saved[:] = None, []
    assert specx_main(_eagle3_argv(tmp_path)) == 0
    # 2 held-out + 6 training prompts in shards of 3: the first survived the kill.
    assert saved == [1, 2]
    assert (shards / "shard-00000.pt").read_bytes() == first
    record = json.loads((tmp_path / "head.work" / "data.done.json").read_text())
    assert (record["heldout_prompts"], record["train_prompts"]) == (2, 6)
    assert record["responses"] == 16
    data = torch.load(tmp_path / "head.work" / "data.pt")
    # Held-out answers are those of the held-out file's prompts, and only those.
    assert {r["prompt_index"] for r in data["heldout"]} == {0, 1}
    assert {r["prompt_index"] for r in data["train"]} == set(range(2, 8))
    assert all(r["response_ids"] for r in data["train"] + data["heldout"])
    # Run again: nothing is generated, the stage is done.
    capsys.readouterr()
    assert specx_main(_eagle3_argv(tmp_path)) == 0 and saved == [1, 2]
    assert "stage data done before" in capsys.readouterr().out

    # The features stage in shards of 3 rows (12 training rows: 4 shards, 4 held-out: 2),
    # killed after 3 shards, resumes with the other 3 and assembles the same tensors as an
    # uninterrupted run from a copy of the same data.
    import shutil

    from vllm_specx.training import eagle3 as eagle3_mod

    work = tmp_path / "head.work"
    shutil.copytree(work, tmp_path / "copy.work")
    features_argv = [a if a != "data" else "features" for a in _eagle3_argv(tmp_path)]
    features_argv += ["--feature-shard-rows", "3", "--seq-len", "32"]
    real_features = eagle3_mod.target_features
    computed: list[int] = []

    def features_then_maybe_die(*args, **kwargs):
        out = real_features(*args, **kwargs)
        computed.append(len(args[1]))
        if kill_after is not None and len(computed) == kill_after:
            raise Killed  # killed while shard 3 is being saved: it does not count
        return out

    monkeypatch.setattr(eagle3_mod, "target_features", features_then_maybe_die)
    kill_after = 3
    with pytest.raises(Killed):
        specx_main(features_argv)
    assert len(list((work / "eagle3_feature_shards").glob("*.pt"))) == 2
    kill_after, computed[:] = None, []
    assert specx_main(features_argv) == 0
    assert computed == [3, 3, 3, 1]  # training shards 2 and 3, held-out shards 0 and 1
    resumed = torch.load(work / "eagle3_features.pt")
    computed[:] = []
    assert specx_main([*features_argv, "--work-dir", str(tmp_path / "copy.work")]) == 0
    assert computed == [3, 3, 3, 3, 3, 1]
    whole = torch.load(tmp_path / "copy.work" / "eagle3_features.pt")
    for split in ("train", "heldout"):
        assert whole[split].keys() == resumed[split].keys()
        for name, tensor in whole[split].items():
            assert torch.equal(tensor, resumed[split][name]), (split, name)
    assert not list((work / "eagle3_feature_shards").glob("*.pt"))  # assembled, removed


def test_heldout_prompts_that_are_training_prompts_are_refused(tmp_path, capsys):
    argv = _eagle3_argv(tmp_path)
    (tmp_path / "held.jsonl").write_text(json.dumps(PROMPTS[2]) + "\n")
    assert specx_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(without_logging_errors(err)) == 1 and "--heldout-prompts" in err and "allowed" in err
    assert not (tmp_path / "head.work" / "data_shards").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["distill-eagle3", "distill"])
def test_device_cuda_without_cuda_is_refused_before_anything_runs(tmp_path, capsys, command):
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    argv = _eagle3_argv(tmp_path, "--device", "cuda")
    argv = [a for a in argv if a not in ("--stop-after", "data")]
    if command == "distill":
        argv[0] = "distill"
        argv += ["--draft-config", "tiny"]
    assert specx_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(without_logging_errors(err)) == 1 and "--device cuda" in err and "allowed" in err
    assert not (tmp_path / "head.work").exists() and not (tmp_path / "head").exists()


def test_distill_restart_forgets_the_data_shards(tmp_path):
    """``distill --restart`` redoes all: the saved answers too, not a reload of the shards."""
    argv = [a if a != "data" else "pretrain" for a in _eagle3_argv(tmp_path)]
    argv[0] = "distill"
    corpus = Path(__file__).resolve().parents[2] / "vllm_specx" / "training" / "data.py"
    argv += ["--draft-config", "tiny", "--corpus", str(corpus), "--pretrain-steps", "1",
             "--pretrain-batch", "2", "--seq-len", "32", "--restart"]
    shards = tmp_path / "head.work" / "data_shards"
    shards.mkdir(parents=True)
    (shards / "shard-00000.pt").write_bytes(b"answers of an earlier run")
    assert specx_main(argv) == 0
    assert not shards.exists()
