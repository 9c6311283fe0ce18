"""The shared tiny-model helpers: deterministic, loadable by vLLM and transformers."""

from __future__ import annotations

import torch

from vllm_specx.testing import tiny_models as tm


def test_tokenizer_is_deterministic_and_has_llama_special_tokens(tmp_path):
    a = tm.build_tokenizer(tmp_path / "a")
    b = tm.build_tokenizer(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        0,
        1,
        2,
        3,
    )
    ids = tok("def f(x):\n    return x")["input_ids"]
    assert ids[0] == tm.BOS_ID and tm.EOS_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"


def test_vllm_and_transformers_tokenize_alike(models):
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    text = "class TextWrapper:\n    def __init__(self, width=70):\n        ü ✓"
    hf = AutoTokenizer.from_pretrained(models.target)
    ours = get_tokenizer(str(models.target))
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.eos_token_id == tm.EOS_ID


def test_models_are_seeded_and_draft_is_the_targets_prefix(models, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    again = tm.make_tiny_llama(tmp_path / "again", seed=0)
    other = tm.make_tiny_llama(tmp_path / "other", seed=1)
    target = load_file(models.target / "model.safetensors")
    assert all(torch.equal(v, load_file(again / "model.safetensors")[k]) for k, v in target.items())
    other_w = load_file(other / "model.safetensors")
    assert not torch.equal(target["lm_head.weight"], other_w["lm_head.weight"])

    cfg = AutoConfig.from_pretrained(models.target)
    assert cfg.num_hidden_layers >= 2 and cfg.num_key_value_heads < cfg.num_attention_heads
    draft = load_file(models.draft / "model.safetensors")
    assert AutoConfig.from_pretrained(models.draft).num_hidden_layers == 1
    assert set(draft) < set(target)  # fewer layers, nothing new
    assert all(torch.equal(v, target[k]) for k, v in draft.items())
    assert (models.draft / "tokenizer.json").read_bytes() == (
        models.target / "tokenizer.json"
    ).read_bytes()
