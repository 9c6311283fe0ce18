"""The shipped training prompts of ``distill-eagle3`` (``vllm_specx/prompts/eagle3_train.jsonl``,
built by ``scripts/build_eagle3_prompts.py``): enough of them, of several kinds and languages,
each with its source and licence, and none of the project's held-out prompts among them or
overlapping them (the fixture pair's held-out stdlib files and snippets, the benchmark's
``real_heldout.jsonl``, the shipped head's REPORT held-out prompts)."""

from __future__ import annotations

import collections
import hashlib
import json
import re
from pathlib import Path

from vllm_specx.fixtures import materialise_heldout
from vllm_specx.training.data import read_prompt_file
from vllm_specx.training.distill import split_prompts

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "vllm_specx" / "prompts"
TRAIN = PROMPTS / "eagle3_train.jsonl"


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def _user(prompt: str) -> str:
    m = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)
    return m.group(1) if m else prompt


def test_ten_times_the_prompts_of_several_kinds_and_languages_with_provenance():
    rows = _rows(TRAIN)
    prompts = read_prompt_file(TRAIN)  # the data stage reads it as it is
    assert len(prompts) == len(rows) >= 1600
    assert len(set(prompts)) == len(prompts)
    assert TRAIN.stat().st_size < 3 * 2**20
    for r in rows:
        assert r["source"] and r["license"] and r["kind"] in ("instruction", "code", "prose")
    kinds = collections.Counter(r["kind"] for r in rows)
    assert min(kinds.values()) >= 100, kinds
    langs = collections.Counter(r["lang"] for r in rows)
    natural = [lang for lang in ("fr", "es", "de", "it", "pt", "nl", "ru", "zh", "ja")
               if langs[lang] >= 20]
    assert len(natural) >= 5, langs
    code_langs = [lang for lang in ("python", "javascript", "c", "rust", "go", "java")
                  if langs[lang] >= 5]
    assert len(code_langs) >= 4, langs
    families = {r["source"].split(":")[0] for r in rows}
    assert {"stdlib", "pydoc_topics", "pypi", "templates", "real_distill"} <= families


def test_heldout_prompts_stay_out_of_training():
    train = _rows(TRAIN)
    distill = _rows(PROMPTS / "real_distill.jsonl")
    _, held_idx = split_prompts(len(distill), 0.1, 0)  # the shipped head's REPORT held-out
    report_held = [distill[i]["prompt"] for i in held_idx]
    # The held-out file shipped for --heldout-prompts is exactly those prompts.
    assert [r["prompt"] for r in _rows(PROMPTS / "eagle3_heldout.jsonl")] == report_held
    fixture_refs = _rows(ROOT / "fixtures" / "models" / "heldout_prompts.jsonl")
    fixture_held = [materialise_heldout(r)["text"] for r in fixture_refs]
    bench_held = [r["prompt"] for r in _rows(PROMPTS / "real_heldout.jsonl")]
    held = [_user(p) for p in report_held + bench_held] + fixture_held
    train_prompts = {r["prompt"] for r in train}
    assert not train_prompts & set(report_held + bench_held)
    # No 40-character stretch (whitespace and case normalised) of a held-out text appears
    # in a training prompt, so neither copies nor near-copies ("# A Python function
    # that X" next to "Write a Python function that X") slipped in.
    windows = {h[i:i + 40] for h in map(_norm, held) for i in range(max(1, len(h) - 39))}
    leaks = [r["source"] for r in train
             if any(t[i:i + 40] in windows for t in [_norm(_user(r["prompt"]))]
                    for i in range(max(1, len(t) - 39)))]
    assert not leaks, leaks[:5]
    # No text from a stdlib file the fixture pair holds out: not the 64 snippets' files,
    # nor any other file its build's hash rule holds out.
    fixture_files = {r["source"].split(":", 1)[1] for r in fixture_refs}

    def held_out_by_fixture_rule(rel: str) -> bool:
        return int(hashlib.sha256(f"1234:{rel}".encode()).hexdigest()[:12], 16) % 20 == 0

    assert all(held_out_by_fixture_rule(f) for f in fixture_files)
    stdlib_files = {r["source"].split(":")[1] for r in train if r["source"].startswith("stdlib:")}
    assert len(stdlib_files) > 50
    assert not stdlib_files & fixture_files
    assert not any(held_out_by_fixture_rule(f) for f in stdlib_files)
