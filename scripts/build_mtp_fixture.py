#!/usr/bin/env python3
"""Build the tiny DeepSeek-V3-architecture target with one MTP layer (``specx_mtp`` fixture).

Same tokenizer (copied from ``fixtures/models/target``) and same training text (the standard
library's source, the same train/held-out split) as the fixture pair of
``scripts/build_fixture_models.py``, whose corpus and training functions this script imports
rather than repeats.

The model: ``DeepseekV3ForCausalLM`` with Multi-head Latent Attention at the sizes vLLM's CPU
MLA backend accepts (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64; block size 16 is forced by
the platform) and at head sizes vLLM's CUDA MLA backends accept too (``qk_nope_head_dim`` 64,
``v_head_dim`` 128: the smallest entry of the FLASH_ATTN prefill backend's list, the only
prefill backend vLLM 0.32 tries on Hopper; the decode backends only need 512 + 64), everything
else tiny: 3 dense layers (``first_k_dense_replace`` past the last
layer, so no MoE anywhere), hidden 192, 2 heads, no q LoRA, untied embeddings, vocab 4096; and
one multi-token-prediction layer (``num_nextn_predict_layers = 1``) stored as
``model.layers.3.*`` the way DeepSeek-V3 checkpoints store theirs (``enorm``, ``hnorm``,
``eh_proj``, a full decoder layer, ``shared_head.norm``, ``shared_head.head``).

Stages:

``target``
    Train the target from scratch on random 256-token windows. Both training stages run
    through the shared ``vllm_specx.training.loop.train_loop`` on windows from
    ``vllm-specx distill``'s sampler (``training.distill.stream_windows``). The committed
    target weights predate that: this script trained them with the fixture pair's old loop
    and window sampler (commits caa1ae4, c8dccdc; 2,500 s), since removed. Rebuilding
    this stage trains the same recipe on other batches (so other weights, and the MTP stage
    must follow); ``--stage mtp --stage report`` rebuilds only the MTP layer on the
    committed target.
``mtp``
    Freeze the target; train the MTP layer by self-distillation: at row ``i`` it sees the
    target's final (post-norm) hidden state at position ``i`` and the embedding of token
    ``i + 1`` (zeroed at position 0, as vLLM's DeepSeek MTP does) and is trained to match the
    target's own next-token distribution at position ``i + 1`` (soft cross-entropy), i.e. to
    predict the token after next. This is exactly the computation vLLM runs at draft step 1;
    steps 2..K reuse the same layer on its own output (not trained for, measured in the
    report).
``widen`` (not part of ``all``)
    Re-express a checkpoint trained at smaller head sizes at this config's
    ``qk_nope_head_dim`` / ``v_head_dim`` without changing the function it computes: the new
    query/key and value columns are zeros, and the queries are scaled by
    ``sqrt(new qk_head_dim / old qk_head_dim)`` so that vLLM's and transformers' softmax scale
    (``qk_head_dim ** -0.5``) gives the same scores. The committed weights were trained at
    ``qk_nope_head_dim`` 32 / ``v_head_dim`` 32 (which no CUDA MLA prefill backend accepts) and
    widened by this stage; ``REPORT.json`` ``stages.widen`` has the largest logit change it
    measured (float rounding only). A rebuild from scratch trains at the new sizes directly.
``report``
    Reload the saved checkpoint, held-out perplexity of the target, and teacher-forced greedy
    agreement of the MTP chain with the target's greedy continuation at depth 1..4 (the
    acceptance per position a greedy ``mtp`` run can reach) and how well the MTP layer's
    own top probability separates its right drafts from wrong ones (what the training-free
    stop reads), into ``REPORT.json``.

Runtime on the shared 2-core machine, 1 torch thread: see ``REPORT.json`` (``stages.*.seconds``).
Deterministic: fixed seeds, one thread; same machine and torch give the same weights.

Usage::

    .venv/bin/python scripts/build_mtp_fixture.py                   # all stages
    .venv/bin/python scripts/build_mtp_fixture.py --quick --out /tmp/mtpfx
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_fixture_models as pair  # noqa: E402  (the fixture pair's corpus and trainer)

REPO_ROOT = pair.REPO_ROOT
TOKENIZER_SOURCE = REPO_ROOT / "fixtures" / "models" / "target"
STAGES = ("target", "mtp", "report")  # what ``all`` runs
ORDER = ("target", "mtp", "widen", "report")  # ``widen`` only when asked for


@dataclasses.dataclass(frozen=True)
class MtpBuildConfig:
    seed: int = 4321
    hidden: int = 192
    layers: int = 3
    heads: int = 2
    intermediate: int = 512
    # The smallest (qk_nope, qk_rope, v) head sizes vLLM 0.32's FLASH_ATTN MLA prefill backend
    # accepts (its supports_mla_dimensions list; tests/mtp/test_mtp_fixture_dims.py reads it),
    # so the fixture runs with MLA on CUDA too. The first build used 32 / 32 (``widen``).
    qk_nope_head_dim: int = 64
    v_head_dim: int = 128
    # Forced by vLLM's CPU_MLA backend (its decode op handles 576-wide latent rows only).
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    seq_len: int = 256
    target_steps: int = 500
    target_batch: int = 8
    target_lr: float = 3e-3
    # ~0.55 s a step at 16 x 128 tokens on one quiet core. The first build trained 60 steps
    # (argmax right 0.74 at depth 1, but probabilities too flat for a confidence stop).
    mtp_steps: int = 2000
    mtp_batch: int = 16
    mtp_seq_len: int = 128
    mtp_lr: float = 2e-3
    eval_windows: int = 32
    agree_prompts: int = 8
    agree_new_tokens: int = 32
    log_every: int = 10


QUICK = MtpBuildConfig(
    hidden=64, layers=1, heads=1, intermediate=128, seq_len=64, target_steps=6,
    mtp_steps=6, eval_windows=4, agree_prompts=2, agree_new_tokens=8, log_every=2,
)


def windows(stream: torch.Tensor, seq_len: int, steps: int, batch: int, seed: int) -> torch.Tensor:
    """``steps * batch`` training windows (bos + seq_len - 1 tokens each) from the shared
    sampler of ``vllm-specx distill``, so every step sees fresh windows."""
    from vllm_specx.training.distill import stream_windows

    return stream_windows(stream.to(torch.int32), seq_len, steps * batch, seed, bos_id=0)


def train(
    model: torch.nn.Module,
    rows: torch.Tensor,
    loss_fn: Any,
    steps: int,
    batch: int,
    lr: float,
    pcfg: Any,
    seed: int,
    label: str,
) -> dict[str, Any]:
    """One pass over ``rows`` through the shared loop (``vllm_specx.training.loop``) with
    the fixture pair's recipe: AdamW (0.9, 0.95), warm-up then cosine to 10% of the peak,
    gradient clipping at 1, no weight decay on norm gains."""
    from vllm_specx.training.loop import train_loop

    t0 = time.time()
    history = train_loop(
        model, (rows,), loss_fn, epochs=1, batch_size=batch, lr=lr, seed=seed,
        weight_decay=pcfg.weight_decay, warmup_frac=pcfg.warmup_frac, desc=label,
        progress=False, log=pair.log, max_steps=steps, betas=(0.9, 0.95), grad_clip=1.0,
        min_lr_ratio=0.1, decay_1d=False,
    )
    return {
        "steps": steps,
        "peak_lr": lr,
        "trained_tokens": steps * batch * (int(rows.shape[1]) - 1),
        "mean_train_loss": round(float(history[-1]["train_loss"]), 4),
        "autocast": "off",
        "threads": torch.get_num_threads(),
        "seconds": round(time.time() - t0, 1),
    }


def pair_config(cfg: MtpBuildConfig, quick: bool) -> Any:
    """The fixture pair's build config, for its corpus split and training-loop settings."""
    base = pair.QUICK if quick else pair.BuildConfig()
    return dataclasses.replace(
        base,
        vocab_size=pair.BuildConfig().vocab_size,  # the committed tokenizer's, quick or not
        seq_len=cfg.seq_len,
        log_every=cfg.log_every,
        threads=1,
        autocast="off",
    )


def deepseek_config(cfg: MtpBuildConfig, vocab_size: int) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        moe_intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        # Past the MTP layer's index too: every layer, the MTP block included, is dense
        # (the CPU engine has no fused-MoE op).
        first_k_dense_replace=cfg.layers + 1,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        head_dim=cfg.qk_rope_head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        initializer_range=0.02,
        num_nextn_predict_layers=1,
        torch_dtype="float32",
    )


class MtpLayer(torch.nn.Module):
    """DeepSeek-V3's MTP module as vLLM 0.32 runs it (``DeepSeekMultiTokenPredictorLayer``).

    ``forward`` returns (pre-norm hidden, post-norm hidden); logits are
    ``head(shared_head_norm(pre-norm))`` and the post-norm hidden feeds the next step.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(h, eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head_norm = DeepseekV3RMSNorm(h, eps)

    def forward(
        self,
        input_embeds: torch.Tensor,  # [B, T, H]: embedding of token i + 1
        prev_hidden: torch.Tensor,  # [B, T, H]: post-norm hidden at position i
        positions: torch.Tensor,  # [B, T]: i
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_embeds = torch.where(positions[..., None] == 0, 0.0, input_embeds)
        x = self.eh_proj(torch.cat([self.enorm(input_embeds), self.hnorm(prev_hidden)], -1))
        out = self.block(
            x, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings
        )
        h = out[0] if isinstance(out, tuple) else out
        return h, self.shared_head_norm(h)


def load_target(path: Path) -> Any:
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model


def save_target(model: Any, out_dir: Path) -> None:
    from transformers import GenerationConfig

    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(out_dir)
    for name in pair.TOKENIZER_FILES:
        shutil.copy2(TOKENIZER_SOURCE / name, out_dir / name)


def mtp_state_dict(mtp: MtpLayer, target: Any, layer: int) -> dict[str, torch.Tensor]:
    """The MTP layer under DeepSeek-V3's checkpoint names (``model.layers.<N>.*``)."""
    prefix = f"model.layers.{layer}."
    state = {
        prefix + "enorm.weight": mtp.enorm.weight,
        prefix + "hnorm.weight": mtp.hnorm.weight,
        prefix + "eh_proj.weight": mtp.eh_proj.weight,
        prefix + "shared_head.norm.weight": mtp.shared_head_norm.weight,
        # DeepSeek-V3 checkpoints carry the MTP layer's own copies of the shared embedding and
        # head; vLLM loads them (the embedding as the drafter's top-level one).
        prefix + "shared_head.head.weight": target.lm_head.weight,
        prefix + "embed_tokens.weight": target.model.embed_tokens.weight,
    }
    for name, tensor in mtp.block.state_dict().items():
        state[prefix + name] = tensor
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def target_hidden(target: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(post-norm final hidden states, logits) of the target, as vLLM hands them to MTP."""
    out = target.model(input_ids=ids)
    hidden = out.last_hidden_state
    return hidden, target.lm_head(hidden)


def mtp_step(
    mtp: MtpLayer, target: Any, tokens: torch.Tensor, prev_hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step over whole rows: row i sees token i + 1 and hidden i. Returns
    (logits, post-norm hidden) per row."""
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    emb = target.model.embed_tokens(tokens)
    rope = target.model.rotary_emb(emb, positions)
    pre, post = mtp(emb, prev_hidden, positions, rope)
    return target.lm_head(post), post


def stage_target(cfg: MtpBuildConfig, pcfg: Any, paths: dict[str, Path]) -> dict[str, Any]:
    from transformers import DeepseekV3ForCausalLM

    train_ids = torch.load(paths["work"] / "train_ids.pt")
    torch.manual_seed(cfg.seed + 1)
    model = DeepseekV3ForCausalLM(deepseek_config(cfg, pcfg.vocab_size)).float()
    model.config._attn_implementation = "sdpa"
    pair.log(f"target: {pair.param_count(model):,} parameters")
    rows = windows(train_ids, cfg.seq_len, cfg.target_steps, cfg.target_batch, cfg.seed + 2)

    def lm_loss(m: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ids = batch[0].long()
        return m(input_ids=ids, labels=ids).loss

    info = train(model, rows, lm_loss, cfg.target_steps, cfg.target_batch, cfg.target_lr, pcfg,
                 cfg.seed + 5, "target")
    save_target(model, paths["target"])
    info.update(params=pair.param_count(model), batch=cfg.target_batch, seq_len=cfg.seq_len)
    return info


def stage_mtp(cfg: MtpBuildConfig, pcfg: Any, paths: dict[str, Path]) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    target = load_target(paths["target"])
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed + 3)
    mtp = MtpLayer(target.config).float()
    # Start the MTP block from the target's last layer: a better start than random for a
    # layer that runs on the same kind of hidden state.
    mtp.block.load_state_dict(target.model.layers[-1].state_dict())
    train_ids = torch.load(paths["work"] / "train_ids.pt")
    rows = windows(train_ids, cfg.mtp_seq_len, cfg.mtp_steps, cfg.mtp_batch, cfg.seed + 4)

    def mtp_loss(m: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ids = batch[0].long()
        with torch.no_grad():
            hidden, logits = target_hidden(target, ids)
            teacher = torch.softmax(logits[:, 1:].float(), -1)  # p(. | t_<=i+1)
        draft_logits, _ = mtp_step(m, target, ids[:, 1:], hidden[:, :-1])
        logq = torch.log_softmax(draft_logits.float(), -1)
        return -(teacher * logq).sum(-1).mean()

    info = train(mtp, rows, mtp_loss, cfg.mtp_steps, cfg.mtp_batch, cfg.mtp_lr, pcfg,
                 cfg.seed + 6, "mtp")
    weights = paths["target"] / "model.safetensors"
    state = load_file(str(weights))
    state.update(mtp_state_dict(mtp, target, target.config.num_hidden_layers))
    save_file(state, str(weights), metadata={"format": "pt"})
    info.update(params=sum(p.numel() for p in mtp.parameters()), batch=cfg.mtp_batch)
    return info


def load_mtp(target: Any, path: Path) -> MtpLayer:
    from safetensors.torch import load_file

    layer = target.config.num_hidden_layers
    prefix = f"model.layers.{layer}."
    state = {k[len(prefix) :]: v for k, v in load_file(str(path / "model.safetensors")).items()
             if k.startswith(prefix)}
    mtp = MtpLayer(target.config).float()
    mtp.enorm.weight.data.copy_(state["enorm.weight"])
    mtp.hnorm.weight.data.copy_(state["hnorm.weight"])
    mtp.eh_proj.weight.data.copy_(state["eh_proj.weight"])
    mtp.shared_head_norm.weight.data.copy_(state["shared_head.norm.weight"])
    block = {k: v for k, v in state.items() if not k.startswith(
        ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    mtp.block.load_state_dict(block)
    mtp.eval()
    return mtp


@torch.no_grad()
def depth_agreement(
    target: Any, mtp: MtpLayer, prompts: list[torch.Tensor], new_tokens: int, depths: int
) -> dict[str, Any]:
    """Teacher-forced greedy agreement of the MTP chain with the target, per draft depth.

    For each prompt, the target's greedy continuation ``y``; at every position ``t`` of it,
    the chain drafts ``depths`` tokens from the target's hidden at ``t - 1`` (as in vLLM:
    step 1 sees token t and hidden t-1, step k its own previous draft and hidden). Depth ``d``
    counts as accepted when drafts 1..d all equal ``y``; the rate per depth is what a greedy
    run accepts at that position given it reached it.

    Also how well the MTP layer's own confidence (its largest probability, unwarped: the
    ``token_prob`` of an argmax draft, which the training-free stop compares with
    ``confidence_threshold``) separates right drafts from wrong ones, over every draft
    made: AUC, and per threshold the share of drafts at or above it and their accuracy.
    """
    from vllm_specx.training.loop import soft_auc

    reached = [0] * depths
    accepted = [0] * depths
    confs: list[float] = []
    rights: list[float] = []
    for prompt in prompts:
        ids = prompt[None]
        for _ in range(new_tokens):
            nxt = target(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
        hidden, _ = target_hidden(target, ids)
        n_prompt = prompt.numel()
        seq = ids[0]
        for t in range(n_prompt, seq.numel() - 1):
            # Draft for positions t+1.. from hidden[t-1] and token t (what vLLM's step-1 row
            # for the last verified token looks like), then recurse on its own outputs.
            toks = seq[: t + 1].clone()
            prev = hidden[0, :t]
            ok = True
            for d in range(depths):
                if t + 1 + d >= seq.numel():
                    break
                logits, post = mtp_step(mtp, target, toks[1:][None], prev[None])
                draft = logits[0, -1].argmax()
                reached[d] += ok
                confs.append(float(torch.softmax(logits[0, -1].float(), -1).max()))
                rights.append(float(draft == seq[t + 1 + d]))
                ok = ok and bool(draft == seq[t + 1 + d])
                accepted[d] += ok
                if not ok:
                    break
                toks = torch.cat([toks, draft.view(1)])
                prev = torch.cat([prev, post[0, -1:]], 0)
    conf, right = torch.tensor(confs), torch.tensor(rights)
    auc = soft_auc(conf, right)  # NaN when every draft was right (or every one wrong)
    by_threshold = {}
    for thr in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        above = conf >= thr
        by_threshold[str(thr)] = {
            "share_at_or_above": round(float(above.float().mean()), 4),
            "accuracy_at_or_above": round(float(right[above].mean()), 4) if above.any() else None,
            "accuracy_below": round(float(right[~above].mean()), 4) if (~above).any() else None,
        }
    return {
        "accept_rate_at_depth": [round(a / max(1, r), 4) for a, r in zip(accepted, reached)],
        "reached_at_depth": reached,
        "confidence": {
            "drafts": len(confs),
            "accuracy": round(float(right.mean()), 4),
            "mean_top_prob": round(float(conf.mean()), 4),
            "auc_top_prob_vs_right": None if auc != auc else round(auc, 4),
            "by_threshold": by_threshold,
        },
    }


def widen_mla_heads(
    state: dict[str, torch.Tensor],
    heads: int,
    rope: int,
    old: tuple[int, int],
    new: tuple[int, int],
) -> dict[str, torch.Tensor]:
    """``state`` with every MLA layer's (``qk_nope_head_dim``, ``v_head_dim``) = ``old``
    re-expressed at ``new`` (each at least as large), computing the same function.

    Per head, ``q_proj`` rows are [nope | rope] and ``kv_b_proj`` rows [k_nope | v]; the new
    nope and v entries are zero rows (so they add nothing to q.k and carry no value), and
    ``o_proj`` gets zero input columns for the new v entries. Attention scales scores by
    ``qk_head_dim ** -0.5``, which grows with nope; scaling the queries by the square root of
    the ratio keeps every score as it was.
    """
    (old_nope, old_v), (new_nope, new_v) = old, new
    if new_nope < old_nope or new_v < old_v:
        raise ValueError(f"widen: cannot shrink head sizes {old} -> {new}")
    q_gain = math.sqrt((new_nope + rope) / (old_nope + rope))
    out = dict(state)
    for key, w in state.items():
        if key.endswith("self_attn.q_proj.weight"):
            w3 = w.reshape(heads, old_nope + rope, -1)
            wide = w3.new_zeros(heads, new_nope + rope, w3.shape[-1])
            wide[:, :old_nope] = w3[:, :old_nope]
            wide[:, new_nope:] = w3[:, old_nope:]
            out[key] = (wide * q_gain).reshape(heads * (new_nope + rope), -1).contiguous()
        elif key.endswith("self_attn.kv_b_proj.weight"):
            w3 = w.reshape(heads, old_nope + old_v, -1)
            wide = w3.new_zeros(heads, new_nope + new_v, w3.shape[-1])
            wide[:, :old_nope] = w3[:, :old_nope]
            wide[:, new_nope : new_nope + old_v] = w3[:, old_nope:]
            out[key] = wide.reshape(heads * (new_nope + new_v), -1).contiguous()
        elif key.endswith("self_attn.o_proj.weight"):
            w3 = w.reshape(w.shape[0], heads, old_v)
            wide = w3.new_zeros(w.shape[0], heads, new_v)
            wide[..., :old_v] = w3
            out[key] = wide.reshape(w.shape[0], heads * new_v).contiguous()
    return out


@torch.no_grad()
def _probe_logits(path: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits, MTP step-1 logits) of the checkpoint in ``path`` on ``ids``."""
    target = load_target(path)
    mtp = load_mtp(target, path)
    hidden, logits = target_hidden(target, ids)
    draft_logits, _ = mtp_step(mtp, target, ids[:, 1:], hidden[:, :-1])
    return logits, draft_logits


def stage_widen(cfg: MtpBuildConfig, pcfg: Any, paths: dict[str, Path]) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    out_dir = paths["target"]
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    old = (config["qk_nope_head_dim"], config["v_head_dim"])
    new = (cfg.qk_nope_head_dim, cfg.v_head_dim)
    if config["qk_rope_head_dim"] != cfg.qk_rope_head_dim:
        raise ValueError("widen: qk_rope_head_dim differs; rope columns cannot be widened")
    weights = out_dir / "model.safetensors"
    info: dict[str, Any] = {"from": list(old), "to": list(new),
                            "weights_bytes_before": weights.stat().st_size}
    if old == new:
        return {**info, "changed": False}
    heldout = torch.load(paths["work"] / "heldout_ids.pt")
    ids = torch.cat([torch.zeros(1, dtype=heldout.dtype), heldout[:255]])[None].long()
    before = _probe_logits(out_dir, ids)
    state = widen_mla_heads(load_file(str(weights)), config["num_attention_heads"],
                            config["qk_rope_head_dim"], old, new)
    config.update(qk_nope_head_dim=new[0], v_head_dim=new[1],
                  qk_head_dim=new[0] + config["qk_rope_head_dim"])
    save_file(state, str(weights), metadata={"format": "pt"})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    after = _probe_logits(out_dir, ids)
    diffs = [float((a - b).abs().max()) for a, b in zip(before, after)]
    same_argmax = [float((a.argmax(-1) == b.argmax(-1)).float().mean())
                   for a, b in zip(before, after)]
    pair.log(f"widen: max |logit change| target {diffs[0]:.2e}, mtp {diffs[1]:.2e}")
    if max(diffs) > 1e-3:
        raise RuntimeError(f"widen changed the model's logits by {max(diffs)}")
    return {**info, "changed": True, "weights_bytes_after": weights.stat().st_size,
            "probe_tokens": int(ids.shape[1]),
            "max_abs_logit_change": {"target": diffs[0], "mtp": diffs[1]},
            "same_argmax": {"target": same_argmax[0], "mtp": same_argmax[1]}}


def stage_report(cfg: MtpBuildConfig, pcfg: Any, paths: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    target = load_target(paths["target"])
    mtp = load_mtp(target, paths["target"])
    heldout = torch.load(paths["work"] / "heldout_ids.pt")
    ppl = pair.window_perplexity(target, heldout, cfg.seq_len, cfg.eval_windows)
    tok = AutoTokenizer.from_pretrained(paths["target"])
    from vllm_specx.fixtures import heldout_prompts

    texts = heldout_prompts(cfg.agree_prompts) if not paths.get("quick") else ["def f(x):\n"]
    prompts = [torch.tensor(tok(t)["input_ids"][:64]) for t in texts]
    depth = depth_agreement(target, mtp, prompts, cfg.agree_new_tokens, 4)
    files = sorted(p.name for p in paths["target"].iterdir())
    return {
        "heldout_perplexity": round(ppl, 3),
        **depth,
        "agree_prompts": len(prompts),
        "agree_new_tokens": cfg.agree_new_tokens,
        "weights_sha256": pair.sha256_file(paths["target"] / "model.safetensors"),
        "weights_bytes": (paths["target"] / "model.safetensors").stat().st_size,
        "files": files,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", action="append", choices=[*ORDER, "all"])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "fixtures" / "models" / "mtp_target")
    ap.add_argument("--work-dir", type=Path, default=REPO_ROOT / ".cache" / "mtp_fixture_build")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else MtpBuildConfig()
    pcfg = pair_config(cfg, args.quick)
    torch.set_num_threads(1)  # fixed: float reductions (so the weights) depend on it
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = args.out.resolve()
    paths: dict[str, Any] = {"target": out, "work": args.work_dir.resolve(), "quick": args.quick}
    report_path = out / "REPORT.json"
    wanted = set(args.stage or ["all"])
    stages = [s for s in ORDER if ("all" in wanted and s in STAGES) or s in wanted]

    work: Path = paths["work"]
    if not (work / "train_ids.pt").exists():
        # The pair's corpus split, encoded with the pair's (committed) tokenizer.
        stdlib, train_rel, heldout_rel = pair.list_corpus(pcfg)
        train = [t for r in train_rel if (t := pair.read_text(stdlib, r)) is not None]
        held = [t for r in heldout_rel if (t := pair.read_text(stdlib, r)) is not None]
        work.mkdir(parents=True, exist_ok=True)
        torch.save(pair.encode_docs(TOKENIZER_SOURCE, train), work / "train_ids.pt")
        torch.save(pair.encode_docs(TOKENIZER_SOURCE, held), work / "heldout_ids.pt")
        pair.log(f"corpus: {len(train)} train files, {len(held)} held-out files")

    report: dict[str, Any] = {}
    for stage in stages:
        t0 = time.time()
        load = [round(x, 2) for x in os.getloadavg()]
        info = {"target": stage_target, "mtp": stage_mtp, "widen": stage_widen,
                "report": stage_report}[stage](
            cfg, pcfg, paths
        )
        info["seconds"] = round(time.time() - t0, 1)
        info["load_average_at_start"] = load
        pair.log(f"{stage}: {json.dumps(info)}")
        if report_path.exists():
            report = json.loads(report_path.read_text())
        report.setdefault("stages", {})[stage] = info
        report["config"] = dataclasses.asdict(cfg)
        report["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}
        report_path.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
