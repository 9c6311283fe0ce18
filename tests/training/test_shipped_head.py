"""The acceptance head shipped for the fixture pair (``fixtures/models/head``): it loads, fits
and names the fixture draft, its training prompts never touch the benchmark's held-out files,
and on held-out code it ranks accepted draft tokens above rejected ones."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_specx.algorithms.acceptance_head import load_head
from vllm_specx.config import acceptance_head_problem
from vllm_specx.fixtures import fixture_model_dirs, fixtures_root, heldout_records
from vllm_specx.training.data import model_summary, read_prompt_file


@pytest.fixture(scope="module")
def head_dir():
    return fixtures_root() / "head"


def test_shipped_head_loads_and_names_the_fixture_draft(head_dir):
    _, draft = fixture_model_dirs()
    cfg = json.loads((head_dir / "config.json").read_text())
    summary = model_summary(draft)
    assert cfg["draft_model"]["name"] == "draft"
    assert cfg["draft_model"]["weights_sha256"] == summary["weights_sha256"]
    assert cfg["hidden_size"] == summary["hidden_size"]
    head = load_head(head_dir)
    assert head.hidden_size == summary["hidden_size"] and head.num_blocks == cfg["num_blocks"]
    assert acceptance_head_problem(str(head_dir), draft_model=str(draft)) is None
    held = cfg["metrics"]["heldout"]
    assert held["rows"] > 1000 and held["auc"] > 0.5
    # Small enough to ship in the repository.
    assert sum(f.stat().st_size for f in head_dir.iterdir()) < 1_000_000


def test_training_prompts_are_disjoint_from_heldout(head_dir):
    refs = [json.loads(line) for line in
            (head_dir / "train_prompts.jsonl").read_text().splitlines() if line]
    heldout = [json.loads(line) for line in
               (fixtures_root() / "heldout_prompts.jsonl").read_text().splitlines() if line]
    assert not {r["source"] for r in refs} & {r["source"] for r in heldout}
    prompts = read_prompt_file(head_dir / "train_prompts.jsonl")
    assert len(prompts) == len(refs)
    assert not set(prompts) & {r["prompt"] for r in heldout_records()}


def test_shipped_head_ranks_acceptance_on_heldout_code(head_dir):
    """Teacher-forced on held-out code the models never saw, the head's P(accept) ranks the
    draft's sampled tokens by their true acceptance probability better than chance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specx.training.data import Response
    from vllm_specx.training.head import score_responses
    from vllm_specx.training.loop import soft_auc

    torch.set_num_threads(1)
    target_dir, draft_dir = fixture_model_dirs()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    responses = []
    for i, rec in enumerate(heldout_records()[:12]):
        ids = tok(rec["text"])["input_ids"][:160]
        n_prompt = len(tok(rec["prompt"])["input_ids"])
        responses.append(Response(ids[:n_prompt], ids[n_prompt:], 1.0, i))
    data = score_responses(target, draft, responses, mix_ratio=0.15, seed=0, batch_size=4,
                           progress=False)
    head = load_head(head_dir)
    with torch.no_grad():
        prob = head.accept_prob(data.features)
    assert data.labels.numel() > 500
    assert soft_auc(prob, data.labels) > 0.55
