#!/usr/bin/env python3
"""Build the tiny DeepSeek-V3-architecture target with one MTP layer (``specx_mtp`` fixture).

Same tokenizer (copied from ``fixtures/models/target``) and same training text (the standard
library's source, the same train/held-out split) as the fixture pair of
``scripts/build_fixture_models.py``, whose corpus and training functions this script imports
rather than repeats.

The model: ``DeepseekV3ForCausalLM`` with Multi-head Latent Attention at the sizes vLLM's CPU
MLA backend accepts (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64; block size 16 is forced by
the platform), everything else tiny: 3 dense layers (``first_k_dense_replace`` past the last
layer, so no MoE anywhere), hidden 192, 2 heads, no q LoRA, untied embeddings, vocab 4096; and
one multi-token-prediction layer (``num_nextn_predict_layers = 1``) stored as
``model.layers.3.*`` the way DeepSeek-V3 checkpoints store theirs (``enorm``, ``hnorm``,
``eh_proj``, a full decoder layer, ``shared_head.norm``, ``shared_head.head``).

Stages:

``target``
    Train the target from scratch on random 256-token windows (the pair's window sampler and
    training loop).
``mtp``
    Freeze the target; train the MTP layer by self-distillation: at row ``i`` it sees the
    target's final (post-norm) hidden state at position ``i`` and the embedding of token
    ``i + 1`` (zeroed at position 0, as vLLM's DeepSeek MTP does) and is trained to match the
    target's own next-token distribution at position ``i + 1`` (soft cross-entropy), i.e. to
    predict the token after next. This is exactly the computation vLLM runs at draft step 1;
    steps 2..K reuse the same layer on its own output (not trained for, measured in the
    report).
``report``
    Reload the saved checkpoint, held-out perplexity of the target, and teacher-forced greedy
    agreement of the MTP chain with the target's greedy continuation at depth 1..4 (the
    acceptance per position a greedy ``mtp`` run can reach), into ``REPORT.json``.

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
STAGES = ("target", "mtp", "report")


@dataclasses.dataclass(frozen=True)
class MtpBuildConfig:
    seed: int = 4321
    hidden: int = 192
    layers: int = 3
    heads: int = 2
    intermediate: int = 512
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    # Forced by vLLM's CPU_MLA backend (its decode op handles 576-wide latent rows only).
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    seq_len: int = 256
    target_steps: int = 500
    target_batch: int = 8
    target_lr: float = 3e-3
    # Kept short: on the shared 2-core machine (load average ~20 at the time) one MTP
    # step took ~12 s at 8 x 256 tokens; the MTP block starts from the target's last layer.
    mtp_steps: int = 60
    mtp_batch: int = 8
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


# The fixture pair's training loop and window sampler as they were when this fixture was
# built (scripts/build_fixture_models.py at commit 7cf6cff): that script has since moved
# its training to vllm_specx.training.distill, whose loop draws batches differently, so
# the loop that made the committed weights is kept here to keep the build reproducible.
def train_loop(
    model: Any,
    next_batch: Any,
    steps: int,
    lr: float,
    cfg: Any,
    label: str,
) -> dict[str, Any]:
    """AdamW with linear warm-up and cosine decay to 10% of the peak rate."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # norm gains
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, int(cfg.warmup_frac * steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t0 = time.time()
    tokens, ema, losses = 0, None, []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        input_ids, labels = next_batch(step)
        # Mixed precision only for the matmuls (weights, grads and optimizer state stay fp32,
        # and the saved models are fp32); on CPUs with AMX/AVX512-BF16 this is ~1.7x faster.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast == "bf16"):
            loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        tokens += int((labels != -100).sum())
        if (step + 1) % cfg.log_every == 0 or step + 1 == steps:
            dt = time.time() - t0
            pair.log(
                f"{label} step {step + 1}/{steps} loss {value:.3f} (ema {ema:.3f}) "
                f"lr {lr_at(step):.2e} {tokens / dt:.0f} tok/s {dt:.0f}s"
            )
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return {
        "steps": steps,
        "peak_lr": lr,
        "trained_tokens": tokens,
        "final_loss": round(sum(tail) / len(tail), 4),
        "autocast": cfg.autocast,
        "threads": cfg.threads,
        "seconds": round(time.time() - t0, 1),
    }


def window_sampler(stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> Any:
    """Random windows of the token stream, each bos + (seq_len - 1) tokens.

    bos opens every window, not just every file: prompts at inference (vLLM, the tokenizer)
    always start with bos and then usually continue mid-file, so bos has to mean "start of
    context". Trained only at file starts, the first models answered every prompt with the
    comment banner that opens a file.
    """
    gen = torch.Generator().manual_seed(seed)
    stream = stream.long()
    bos = torch.zeros(1, dtype=torch.long)

    def next_batch(_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=gen)
        x = torch.stack([torch.cat([bos, stream[s : s + seq_len - 1]]) for s in starts.tolist()])
        return x, x

    return next_batch


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
    sampler = window_sampler(train_ids, cfg.seq_len, cfg.target_batch, cfg.seed + 2)
    info = train_loop(model, sampler, cfg.target_steps, cfg.target_lr, pcfg, "target")
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
    sampler = window_sampler(train_ids, cfg.mtp_seq_len, cfg.mtp_batch, cfg.seed + 4)

    class Wrapped(torch.nn.Module):
        """train_loop's interface: model(input_ids, labels).loss."""

        def __init__(self) -> None:
            super().__init__()
            self.mtp = mtp

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
            with torch.no_grad():
                hidden, logits = target_hidden(target, input_ids)
                teacher = torch.softmax(logits[:, 1:].float(), -1)  # p(. | t_<=i+1)
            draft_logits, _ = mtp_step(self.mtp, target, input_ids[:, 1:], hidden[:, :-1])
            logq = torch.log_softmax(draft_logits.float(), -1)
            loss = -(teacher * logq).sum(-1).mean()
            return type("Out", (), {"loss": loss})()

    wrapped = Wrapped()
    info = train_loop(wrapped, sampler, cfg.mtp_steps, cfg.mtp_lr, pcfg, "mtp")
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
    """
    reached = [0] * depths
    accepted = [0] * depths
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
                ok = ok and bool(draft == seq[t + 1 + d])
                accepted[d] += ok
                if not ok:
                    break
                toks = torch.cat([toks, draft.view(1)])
                prev = torch.cat([prev, post[0, -1:]], 0)
    return {
        "accept_rate_at_depth": [round(a / max(1, r), 4) for a, r in zip(accepted, reached)],
        "reached_at_depth": reached,
    }


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
    ap.add_argument("--stage", action="append", choices=[*STAGES, "all"])
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
    stages = [s for s in STAGES if "all" in wanted or s in wanted]

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
        info = {"target": stage_target, "mtp": stage_mtp, "report": stage_report}[stage](
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
