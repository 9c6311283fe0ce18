"""The real pair in the real engine: SmolLM2-135M-Instruct (fetched and converted by
``vllm_specx.real_pair``, from the user's cache after the first run) with its shipped
drafter, greedy: every lossless speculative method returns exactly the tokens of no
speculation. Few prompts, few tokens: a 30-layer target on a 2-core CPU.

Without a shipped drafter (an install that predates it) the draft is the target's first
two layers with its embeddings and head: same tokenizer, agrees sometimes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_specx import real_pair

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
K = 4
ENGINE = {"kv_cache_memory_bytes": 128 << 20, "max_num_seqs": 4, "max_model_len": 256}


@pytest.fixture(scope="module")
def target() -> Path:
    try:
        return real_pair.ensure_target()
    except real_pair.RealPairError as exc:
        pytest.skip(f"the real target cannot be had here: {exc}")


def _truncated_draft(target: Path, out: Path, keep_layers: int = 2) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    full = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    config = full.config.__class__.from_dict(full.config.to_dict())
    config.num_hidden_layers = keep_layers
    draft = LlamaForCausalLM(config).to(torch.float32)
    draft.load_state_dict(full.state_dict(), strict=False)
    draft.save_pretrained(out)
    for file in target.iterdir():
        if file.name.startswith("tokenizer") or file.name == "chat_template.jinja":
            shutil.copyfile(file, out / file.name)
    return out


@pytest.fixture(scope="module")
def draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return real_pair.draft_dir()
    except real_pair.RealPairError:
        return _truncated_draft(target, tmp_path_factory.mktemp("smollm2_first_layers"))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    import json

    rows = [json.loads(line) for line in real_pair.HELDOUT_PROMPTS.open(encoding="utf-8")]
    # One of each kind: code, prose, a chat-formatted instruction.
    return [next(r["prompt"] for r in rows if r["kind"] == kind)
            for kind in ("code", "prose", "instruction")]


def _greedy(target: Path, prompts: list[str], speculative_config: dict | None) -> list[list[int]]:
    from vllm import SamplingParams

    from vllm_specx.engine import make_llm, shutdown_llm

    llm = make_llm(target, speculative_config=speculative_config, **ENGINE)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def baseline(target: Path, prompts: list[str]) -> list[list[int]]:
    return _greedy(target, prompts, None)


def test_greedy_real_pair_equals_no_speculation(target: Path, draft: Path, prompts: list[str],
                                                baseline: list[list[int]]):
    # adaptive: the lossless specx method (one engine start; the others are proven lossless
    # on the fixture pair, and each start of this target costs tens of seconds here).
    assert all(len(tokens) == MAX_TOKENS for tokens in baseline)
    config = {"method": "adaptive", "num_speculative_tokens": K, "model": str(draft)}
    assert _greedy(target, prompts, config) == baseline


def test_the_real_target_writes_the_code_it_is_asked_for(baseline: list[list[int]],
                                                         target: Path):
    # A converted model that loads but computes garbage would still be "lossless" above.
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(target).decode(baseline[0])
    # The prompt asks for merge_sorted(a, b); SmolLM2 answers about it by name.
    assert "merge" in text, text
