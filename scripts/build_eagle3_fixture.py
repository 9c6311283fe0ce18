#!/usr/bin/env python3
"""Write a test EAGLE-3 head for the fixture target, in vLLM's ``eagle3`` checkpoint format.

The head fits ``fixtures/models/target`` (Llama, hidden 256, 4 layers, vocab 4096) the way a
published EAGLE-3 head fits its target (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``):

* ``config.json``: ``LlamaForCausalLMEagle3``, one layer at the target's width,
  ``target_hidden_size``, ``draft_vocab_size`` (a reduced draft vocabulary) and
  ``eagle_config`` with ``use_aux_hidden_state`` and ``eagle_aux_hidden_state_layer_ids``
  (the target layers whose outputs ``fc`` reads, concatenated);
* ``model.safetensors``: ``midlayer.*`` (q/k/v over ``[embedding | hidden]``, i.e. twice the
  width; ``hidden_norm``; the MLP), ``fc`` (3 x 256 -> 256), ``norm``, ``lm_head`` over the
  draft vocabulary and ``d2t`` (draft id -> target id offset, vLLM adds it to the draft id).
  No ``embed_tokens``: vLLM shares the target's embedding, as for published heads.

The weights are briefly fitted, not trained (training real heads is issue 24's
``vllm-specx distill`` work): ``lm_head`` is the target's (tied) embedding restricted to the
draft vocabulary, the decoder layer adds little (small random attention and MLP outputs),
and ``fc`` is a ridge regression, fitted in closed form on the fixture's held-out text with
the target in transformers (teacher-forced, a second), from the three auxiliary hidden
states at position ``i`` to the (RMS-normalised) embedding of token ``i + 2`` -- what
vLLM's first draft step predicts. Its first drafts match the target about a fifth of the
time, so drafts are sometimes accepted and sometimes not, and its top probability varies
between positions, so the adaptive stop's confidence rule stops some drafts and not others.
The lossless tests need no more (greedy output equals no speculation whatever the drafts
are). The draft vocabulary is the target's most frequent tokens in the same text (ties and
the rest by id).

About 4.7 MB in float32 and built in seconds, so the tests build it into a
temporary directory (:func:`build`) instead of committing it.

Usage::

    .venv/bin/python scripts/build_eagle3_fixture.py --out /tmp/eagle3_head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET = REPO_ROOT / "fixtures" / "models" / "target"
SEED = 2024
DRAFT_VOCAB = 1024
AUX_LAYER_IDS = (1, 2, 3)
INTERMEDIATE = 512
# The final norm's weight: scales the logits (embedding rows . post-norm hidden state),
# so the head's top probability spreads over (0, 1) across positions.
NORM_SCALE = 4.0


def head_config(target: dict[str, Any], draft_vocab: int = DRAFT_VOCAB,
                aux_layer_ids: tuple[int, ...] = AUX_LAYER_IDS) -> dict[str, Any]:
    """The head's ``config.json`` for a Llama target's ``config.json``."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "rope_parameters", "vocab_size",
            "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")
    config = {k: target[k] for k in keys if k in target}
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        intermediate_size=INTERMEDIATE,
        tie_word_embeddings=False,
        torch_dtype="float32",
        draft_vocab_size=draft_vocab,
        target_hidden_size=target["hidden_size"],
        eagle_config={
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        },
    )
    return config


def draft_vocabulary(target: Path, size: int) -> torch.Tensor:
    """The ``size`` target ids most frequent in the fixture's held-out text (then by id)."""
    from transformers import AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts

    tok = AutoTokenizer.from_pretrained(str(target))
    vocab = len(tok)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for text in heldout_prompts(64):
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.int64)
        counts += torch.bincount(ids[ids < vocab], minlength=vocab)
    # Most frequent first; stable, so ties keep id order.
    order = torch.sort(-counts, stable=True).indices
    return order[:size].sort().values


def fit_fc(target: Path, config: dict[str, Any], embedding: torch.Tensor,
           ridge: float = 1.0) -> torch.Tensor:
    """``fc`` (``[hidden, n_aux * target_hidden]``): the ridge regression from the target's
    auxiliary hidden states at position ``i`` (vLLM collects layer ``l``'s input, the
    residual stream, i.e. transformers' ``hidden_states[l]``) to the RMS-normalised
    embedding of token ``i + 2``, on the held-out text, teacher-forced."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_specx.fixtures import heldout_prompts

    layer_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    features, wanted = [], []
    with torch.no_grad():
        for text in heldout_prompts(64):
            ids = torch.tensor([tok(text)["input_ids"][:128]])
            if ids.shape[1] < 3:
                continue
            states = model(ids, output_hidden_states=True).hidden_states
            features.append(torch.cat([states[i][0, :-2] for i in layer_ids], dim=-1))
            wanted.append(ids[0, 2:])
    x = torch.cat(features).double()
    y = embedding[torch.cat(wanted)].double()
    y = y / y.pow(2).mean(-1, keepdim=True).sqrt()
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(x.T @ x + ridge * eye, x.T @ y)  # [n_aux * target_hidden, hidden]
    return w.T.float().contiguous()


def head_weights(config: dict[str, Any], target: Path = TARGET,
                 seed: int = SEED) -> dict[str, torch.Tensor]:
    """The copy head's weights (module doc), with the shapes vLLM's
    ``Eagle3LlamaForCausalLM`` loads."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    target_hidden = config["target_hidden_size"]

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    std, small = 0.02, 0.002
    draft_ids = draft_vocabulary(target, config["draft_vocab_size"])
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight").float()
    lm_head = torch.zeros(config["draft_vocab_size"], hidden)
    width = min(hidden, embedding.shape[1])
    lm_head[:, :width] = embedding[draft_ids, :width]
    target_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    fits = hidden == target_hidden == embedding.shape[1] and all(
        0 <= i < target_layers for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    # A head that does not fit the target (the refusal tests): the shapes only.
    fc = fit_fc(target, config, embedding) if fits else randn(
        hidden, n_aux * target_hidden, std=std)
    return {
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": randn(q_out, 2 * hidden, std=std),
        "midlayer.self_attn.k_proj.weight": randn(kv_out, 2 * hidden, std=std),
        "midlayer.self_attn.v_proj.weight": randn(kv_out, 2 * hidden, std=std),
        "midlayer.self_attn.o_proj.weight": randn(hidden, q_out, std=small),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden, std=std),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden, std=std),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter, std=small),
        "fc.weight": fc,
        "norm.weight": torch.full((hidden,), NORM_SCALE),
        "lm_head.weight": lm_head,
        # vLLM maps draft id i to target id i + d2t[i].
        "d2t": (draft_ids - torch.arange(len(draft_ids))).to(torch.int64),
    }


def build(out: Path, target: Path = TARGET, **overrides: Any) -> Path:
    """Write the head for ``target`` into ``out``; ``overrides`` replace config keys (the
    tests build heads that do not fit, e.g. another ``target_hidden_size``)."""
    target_config = json.loads((target / "config.json").read_text())
    config = head_config(target_config)
    config.update(overrides)
    out.mkdir(parents=True, exist_ok=True)
    weights = head_weights(config, target)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", type=Path, default=TARGET)
    args = parser.parse_args()
    print(build(args.out, args.target))


if __name__ == "__main__":
    main()
