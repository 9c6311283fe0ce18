"""``vllm-specx distill-eagle3`` on the fixture pair: the unrolled training forward equals
vLLM's step-by-step drafting, and end to end with a tiny budget the exported head loads in
vLLM's plain ``eagle3`` (greedy output equal to no speculation, drafts proposed and some
accepted), the stages resume, and bad input is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.cli_output import without_logging_errors
from vllm_specx.cli import main as specx_main
from vllm_specx.fixtures import fixture_model_dirs
from vllm_specx.training.eagle3 import (
    Eagle3Head,
    Eagle3Options,
    _shift_right,
    default_aux_layer_ids,
    head_config,
)

PROMPTS = [
    "def parse_args(argv):\n    parser = ",
    {"prompt": "class Node:\n    def __init__(self, value):\n"},
    "import os\n\ndef walk(path):\n",
    {"prompt": "    for key, value in sorted(items.items()):\n"},
    "def __repr__(self):\n        return ",
    "with open(path, encoding=\"utf-8\") as f:\n    ",
]


def _sequential_chain(head: Eagle3Head, tokens: torch.Tensor, hidden1: torch.Tensor,
                      start: int, depth_count: int) -> list[torch.Tensor]:
    """vLLM's drafting written out one forward at a time for one row: step 1 over positions
    0..start (a KV cache of the real context), then each later step ONE query at the next
    position, fed the previous step's pre-norm output, attending to the cache plus the
    chain's own earlier keys. Returns the post-norm output of each step."""
    nh, nkv, d = head.heads, head.kv_heads, head.head_dim
    rep = nh // nkv

    def project(tok: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor):
        x = torch.cat([head.input_layernorm(head.embed[tok]), head.hidden_norm(hid)], -1)
        q = head.q_proj(x).view(-1, nh, d).transpose(0, 1)
        k = head.k_proj(x).view(-1, nkv, d).transpose(0, 1)
        v = head.v_proj(x).view(-1, nkv, d).transpose(0, 1)
        return head._rope(q[None], pos)[0], head._rope(k[None], pos)[0], v

    def finish(attn: torch.Tensor, residual: torch.Tensor):
        residual = residual + head.o_proj(attn)
        m = head.post_attention_layernorm(residual)
        pre = residual + head.down_proj(torch.nn.functional.silu(head.gate_proj(m))
                                        * head.up_proj(m))
        return head.norm(pre), pre

    def attend(q, k, v, mask):
        s = (q @ k.repeat_interleave(rep, 0).transpose(-1, -2)) / math.sqrt(d)
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.softmax(s, -1) @ v.repeat_interleave(rep, 0)
        return out.transpose(0, 1).reshape(-1, nh * d)

    pos = torch.arange(start + 1)
    q, k_cache, v_cache = project(tokens[:start + 1], hidden1[:start + 1], pos)
    causal = pos[None, :] <= pos[:, None]
    post, pre = finish(attend(q, k_cache, v_cache, causal[None]), hidden1[:start + 1])
    outs = [post[start]]
    hid = pre[start:start + 1]
    for step in range(1, depth_count):
        p = torch.tensor([start + step])
        q, k, v = project(tokens[start + step:start + step + 1], hid, p)
        k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
        allowed = torch.ones(1, 1, k_cache.shape[1], dtype=torch.bool)
        post, pre = finish(attend(q, k_cache, v_cache, allowed), hid)
        outs.append(post[0])
        hid = pre
    return outs


def test_unrolled_training_forward_equals_step_by_step_drafting():
    target, _ = fixture_model_dirs()
    config = head_config(target, Eagle3Options(draft_vocab=64))
    torch.manual_seed(0)
    head = Eagle3Head(config, torch.randn(4096, 256) * 0.5)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05) if p.dim() == 2 else torch.nn.init.uniform_(p, 0.5, 1.5)
    t, steps = 12, 4
    tokens = torch.randint(0, 4096, (1, t))
    aux = torch.randn(1, t, 3 * 256)
    with torch.no_grad():
        hidden = head.fc(aux)
        positions = torch.arange(t)
        keys, values, posts, h = [], [], [], hidden
        for depth in range(steps):
            post, pre, k, v = head.step(tokens, h, positions, keys, values, depth)
            keys.append(k)
            values.append(v)
            posts.append(post)
            h = _shift_right(pre, 1)
        for start in (0, 3, 7):
            chain = _sequential_chain(head, tokens[0], hidden[0], start, steps)
            for depth, expected in enumerate(chain):
                # Step depth+1 of the chain that starts at `start` sits at start + depth.
                torch.testing.assert_close(posts[depth][0, start + depth], expected,
                                           rtol=1e-4, atol=1e-4)


def test_default_aux_layers_are_vllms_for_llama():
    assert default_aux_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M: vLLM's (2, L/2, L-3)
    assert default_aux_layer_ids(4) == (1, 2, 3)  # the fixture target: three distinct layers


def _argv(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    target, _ = fixture_model_dirs()
    return ["distill-eagle3", "--target", str(target), "--prompts", str(prompts), "-o",
            str(out), "--max-tokens", "16", "--seq-len", "64", "--draft-vocab", "1024",
            "--steps", "20", "--batch", "4", "--eval-every", "10", "--report-k", "2",
            "--report-max-tokens", "24", "--heldout-fraction", "0.34", "--seed", "7",
            "--no-progress", *extra]


@pytest.mark.engine
def test_distill_eagle3_end_to_end_head_loads_in_vllm_eagle3(tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "head"
    assert specx_main(_argv(tmp_path, out)) == 0
    report = json.loads((out / "REPORT.json").read_text())
    # Served by vLLM's own eagle3 method on the held-out prompts: drafts were proposed and
    # accepted, and greedy output equals no speculation.
    served = report["vllm_heldout"]["k=2"]
    assert served["greedy_equal_to_no_speculation"] is True
    assert served["rounds"] > 0 and served["accepted_tokens"] > 0
    assert 1.0 < served["block_efficiency"] <= 3.0
    assert len(served["acceptance_by_position"]) == 2
    assert 0.0 < report["vllm_first_token_greedy_agreement"] <= 1.0
    vocab = report["stages"]["vocab"]
    assert 0.5 < vocab["coverage_heldout_target_greedy"] <= 1.0
    curve = report["curve"]
    assert [c["step"] for c in curve] == [10, 20]
    assert curve[0]["positions_trained"] < curve[1]["positions_trained"]
    assert len(curve[-1]["heldout_agreement_by_step"]) == 3  # the default --ttt-steps
    # vLLM's checkpoint format: one midlayer at the target's width, fc over three aux
    # layers, a reduced vocabulary mapped by d2t offsets, no embed_tokens (shared).
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        d2t, fc = f.get_tensor("d2t"), f.get_tensor("fc.weight")
        q = f.get_tensor("midlayer.self_attn.q_proj.weight")
        lm_head = f.get_tensor("lm_head.weight")
    assert not any("embed_tokens" in n for n in names)
    assert fc.shape == (256, 3 * 256) and q.shape == (256, 512) and lm_head.shape == (1024, 256)
    assert fc.dtype == torch.bfloat16
    target_ids = torch.arange(1024) + d2t
    assert bool((target_ids[1:] > target_ids[:-1]).all()) and int(target_ids.max()) < 4096
    # A second run with the same inputs resumes: every stage is skipped, nothing changes;
    # a time budget says when to stop, not what is trained, so a run that finished its
    # steps is also done under another --max-minutes.
    before = (out / "model.safetensors").read_bytes()
    for extra in ((), ("--max-minutes", "30")):
        capsys.readouterr()
        assert specx_main(_argv(tmp_path, out, *extra)) == 0
        logged = capsys.readouterr().out
        for stage in ("data", "features", "vocab", "train", "report"):
            assert f"stage {stage} done before, skipped" in logged, (extra, logged)
        assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("extra, key", [
    (("--aux-layers", "1,9"), "--aux-layers [1, 9]"),
    (("--ttt-steps", "0"), "ttt_steps=0"),
    (("--report-k", "0"), "report_k=[0]"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, capsys, extra, key):
    assert specx_main(_argv(tmp_path, tmp_path / "head", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(without_logging_errors(err)) == 1 and key in err and "allowed" in err
    assert not (tmp_path / "head").exists()


def test_shipped_smollm2_head_fits_the_real_target_and_is_in_the_bench_defaults():
    """The head shipped as package data: vLLM's eagle3 format for SmolLM2-135M-Instruct
    (width 576, vocabulary 49152, vLLM's default aux layers), within the 30 MB budget, its
    REPORT.json from vLLM with greedy output equal at every K; the real pair's bench
    defaults run vLLM's eagle3 and specx_eagle3 over it."""
    import argparse

    from safetensors import safe_open

    from vllm_specx.bench.cli import REAL_PAIR_EAGLE3_K, _parsed_configs
    from vllm_specx.real_pair import eagle3_dir

    head = eagle3_dir()
    assert head is not None
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["hidden_size"], config["target_hidden_size"], config["vocab_size"]) == (
        576, 576, 49152)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert (head / "model.safetensors").stat().st_size <= 30 * 2**20
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
        assert f.get_tensor("lm_head.weight").shape == (config["draft_vocab_size"], 576)
    target_ids = torch.arange(len(d2t)) + d2t
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < 49152
    report = json.loads((head / "REPORT.json").read_text())
    assert report["stages"]["vocab"]["coverage_heldout_target_greedy"] >= 0.95
    served = report["vllm_heldout"]
    assert all(served[f"k={k}"]["greedy_equal_to_no_speculation"] for k in (1, 2, 3, 4))
    assert served["k=3"]["block_efficiency"] > served["k=1"]["block_efficiency"] > 1.0
    args = argparse.Namespace(config=None, num_speculative_tokens=None)
    configs = [cfg for _, cfg in _parsed_configs(args, "real")]
    assert {"method": "eagle3", "model": str(head),
            "num_speculative_tokens": REAL_PAIR_EAGLE3_K} in configs
    assert {"method": "specx_eagle3", "model": str(head), "adaptive": True} in configs
    assert all(c.get("model") == str(head) for c in configs
               if c["method"] in ("eagle3", "specx_eagle3", "specx_eagle"))
