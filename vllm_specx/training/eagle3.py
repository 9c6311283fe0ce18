"""Train an EAGLE-3 head for a target: ``vllm-specx distill-eagle3``.

An EAGLE-3 head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test") is one decoder layer that reads the target's own hidden
states. This module trains one for a Llama target and writes it in vLLM's ``eagle3``
checkpoint format, which ``vllm/model_executor/models/llama_eagle3.py`` loads unchanged:
``midlayer.*`` (q/k/v over ``[embedding | hidden]``, i.e. twice the width), ``fc`` over the
concatenated auxiliary hidden states of ``eagle_aux_hidden_state_layer_ids``, ``norm``,
``lm_head`` over a reduced draft vocabulary and ``d2t`` (draft id -> target id offset). No
``embed_tokens``: vLLM shares the target's embedding.

The forward trained here is vLLM's, step for step (vLLM 0.32, ``llm_base_proposer.py`` and
``llama_eagle3.py``):

* step 1 at position ``j``: token ``j + 1``'s embedding (``input_layernorm``) beside
  ``hidden_norm(fc(aux[j]))``, where ``aux[j]`` concatenates the target's residual stream at
  the input of each auxiliary layer (transformers' ``hidden_states[l]``); the layer's
  residual is ``fc(aux[j])`` itself (norm after residual);
* the output ``norm(mlp + residual)`` gives the logits; the pre-norm sum ``mlp + residual``
  is what step 2 is fed as its hidden state, at the next position, with the step-1 draft
  token's embedding; and so on for steps 3..K;
* a draft at step ``s`` attends to the step-1 keys of the real context (positions up to the
  chain's start) and to the keys its own chain wrote at steps 2..s.

Training unrolls that ("training-time test"): every position starts a chain, step ``s`` at
position ``j`` is fed the step ``s - 1`` pre-norm output at ``j - 1``, and its attention
sees exactly the keys above. Along an accepted chain the draft tokens are the target's, so
the input token at position ``j`` is token ``j + 1`` at every step; the teacher is the
target's distribution at ``j + 1`` over the draft vocabulary (soft cross-entropy), computed
on the fly from the target's final hidden state, which is cached with the auxiliary states.

Stages, each resumable in the work directory:

``data``     the target answers the prompts in vLLM (``distill``'s data stage, shared: the
             same work directory serves both commands);
``features`` the target teacher-forced in transformers on prompt + answer rows (and raw-text
             windows with ``--corpus``): auxiliary states, final hidden state, greedy token;
``vocab``    the draft vocabulary: the target's most frequent greedy tokens on the training
             rows; its coverage of the held-out greedy tokens;
``train``    the head, seeded; a checkpoint every ``eval_every`` steps (a killed run resumes
             there); the held-out curve (agreement per step against tokens and minutes);
``report``   ``REPORT.json``: the saved head served by vLLM's ``eagle3`` on the held-out
             prompts at K = 1..4 (acceptance from the engine's counters; greedy output
             compared with no speculation), plus the teacher-forced curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_specx.training.distill import (
    DEVICES,
    DistillJob,
    DistillOptions,
    DistillRun,
    _log,
    _read_config,
    _stage_done,
    _write_json,
    autocast_on_device,
    data_stage_problems,
    resolve_device,
    run_data,
)

EAGLE3_STAGES = ("data", "features", "vocab", "train", "report")


@dataclass(frozen=True)
class Eagle3Options:
    """Every knob of ``distill-eagle3`` (recorded in REPORT.json)."""

    seed: int = 0
    temperatures: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0)
    max_tokens: int = 128
    heldout_fraction: float = 0.1
    seq_len: int = 256
    corpus_windows: int = 0
    draft_vocab: int = 8192
    aux_layer_ids: tuple[int, ...] | None = None
    intermediate: int | None = None
    ttt_steps: int = 3
    ttt_decay: float = 0.8
    steps: int = 1000
    batch: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    min_lr_ratio: float = 0.1
    max_minutes: float | None = None
    eval_every: int = 100
    report_k: tuple[int, ...] = (1, 2, 3, 4)
    report_max_tokens: int = 64
    save_dtype: str = "bfloat16"
    threads: int = 1
    autocast: str = "auto"
    data_shard_prompts: int = 128
    device: str = "cpu"
    feature_shard_rows: int = 2048

    def check(self) -> None:
        """One clear line per bad value, before anything starts."""
        problems = [
            *data_stage_problems(self),
            ("corpus_windows", self.corpus_windows, self.corpus_windows >= 0,
             "an integer >= 0"),
            ("draft_vocab", self.draft_vocab, self.draft_vocab >= 2, "an integer >= 2"),
            ("ttt_steps", self.ttt_steps, 1 <= self.ttt_steps <= 16, "an integer in 1..16"),
            ("ttt_decay", self.ttt_decay, 0 < self.ttt_decay <= 1, "a number in (0, 1]"),
            ("steps", self.steps, self.steps >= 1, "an integer >= 1"),
            ("batch", self.batch, self.batch >= 1, "an integer >= 1"),
            ("lr", self.lr, self.lr > 0, "a number > 0"),
            ("grad_clip", self.grad_clip, self.grad_clip > 0, "a number > 0"),
            ("max_minutes", self.max_minutes, self.max_minutes is None or self.max_minutes > 0,
             "a number > 0"),
            ("eval_every", self.eval_every, self.eval_every >= 1, "an integer >= 1"),
            ("report_k", list(self.report_k),
             all(1 <= k <= 16 for k in self.report_k), "integers in 1..16 (none: no report "
             "in vLLM)"),
            ("save_dtype", self.save_dtype, self.save_dtype in ("float32", "bfloat16",
                                                                 "float16"),
             "float32, bfloat16 or float16"),
            ("threads", self.threads, self.threads >= 1, "an integer >= 1"),
            ("autocast", self.autocast, self.autocast in ("auto", "bf16", "off"),
             "auto, bf16 or off"),
            ("device", self.device, self.device in DEVICES, ", ".join(DEVICES)),
            ("feature_shard_rows", self.feature_shard_rows, self.feature_shard_rows >= 1,
             "an integer >= 1"),
        ]
        for name, value, ok, allowed in problems:
            if not ok:
                raise ValueError(f"distill-eagle3: {name}={value!r} is not allowed; "
                                 f"allowed: {allowed}")

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    def distill_options(self) -> DistillOptions:
        """The options ``distill``'s data stage reads (the same data, the same marker)."""
        return DistillOptions(seed=self.seed, temperatures=self.temperatures,
                              max_tokens=self.max_tokens,
                              heldout_fraction=self.heldout_fraction, seq_len=self.seq_len,
                              threads=self.threads, autocast=self.autocast,
                              data_shard_prompts=self.data_shard_prompts)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default for Llama targets, ``(2, L // 2, L - 3)``
    (``get_eagle3_default_aux_hidden_state_layers``); for targets too shallow for three
    distinct layers, (1, L // 2, L - 1). Written into the head's config, so vLLM collects
    exactly these."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids):
        return ids
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))


# --------------------------------------------------------------------------------------------
# The head: vLLM's Eagle3 Llama layer in plain torch.
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Head(nn.Module):
    """One EAGLE-3 layer with the parameter names of vLLM's checkpoint format (module doc).
    ``embed`` (the target's input embedding) is a frozen buffer, not saved."""

    def __init__(self, config: dict[str, Any], embed: torch.Tensor) -> None:
        super().__init__()
        h = int(config["hidden_size"])
        self.hidden = h
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or h // self.heads)
        eps = float(config.get("rms_norm_eps", 1e-5))
        inter = int(config["intermediate_size"])
        n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        target_h = int(config["target_hidden_size"])
        self.fc = nn.Linear(n_aux * target_h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, int(config["draft_vocab_size"]), bias=False)
        self.register_buffer("embed", embed.float(), persistent=False)
        rope = config.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Llama's default (neox-style) rotary embedding; x: [B, heads, T, D].
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             keys: list[torch.Tensor], values: list[torch.Tensor], depth: int,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One drafting step over all positions ``[B, T]`` at once (``depth`` = s - 1).

        ``keys``/``values`` hold the earlier steps' keys and values ([B, kv, T, D], step 1
        first). Returns (post-norm output, pre-norm output, this step's keys, values)."""
        emb = self.input_layernorm(self.embed[tokens])
        residual = hidden
        x = torch.cat([emb, self.hidden_norm(hidden)], dim=-1)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        all_k, all_v = [*keys, k], [*values, v]
        rep = self.heads // self.kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)
        # Step-1 keys of the real context: query j (a chain started at p = j - depth) sees
        # key positions <= p.
        k1 = all_k[0].repeat_interleave(rep, dim=1)
        v1 = all_v[0].repeat_interleave(rep, dim=1)
        scores = [torch.matmul(q, k1.transpose(-1, -2)) * scale]
        idx = torch.arange(t, device=x.device)
        allowed = idx[None, :] <= (idx[:, None] - depth)
        scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
        # The chain's own keys of steps 2..s: step u's key sits depth+1-u positions back.
        diag_v = []
        for u in range(1, depth + 1):
            shift = depth - u
            ku = _shift_right(all_k[u], shift).repeat_interleave(rep, dim=1)
            vu = _shift_right(all_v[u], shift).repeat_interleave(rep, dim=1)
            scores.append((q * ku).sum(-1, keepdim=True) * scale)
            diag_v.append(vu)
        s = torch.cat(scores, dim=-1)
        # Queries whose chain would start before position 0 see no key; keep them finite
        # (their loss is masked).
        s = torch.nan_to_num(s, neginf=-1e9) if depth > 0 else s
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        out = torch.matmul(p[..., :t], v1)
        for u, vu in enumerate(diag_v):
            out = out + p[..., t + u:t + u + 1] * vu
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        attn = self.o_proj(out)
        residual = residual + attn
        mlp_in = self.post_attention_layernorm(residual)
        mlp = self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
        prenorm = residual + mlp
        return self.norm(prenorm), prenorm, k, v

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int,
               ) -> list[torch.Tensor]:
        """The training-time-test unroll: logits over the draft vocabulary of steps 1..steps
        at every position ``j`` (input token ``tokens[:, j + 1]`` is passed in already
        shifted: ``tokens`` is ``[B, T]`` with T query positions)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device)
        hidden = self.fc(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        logits = []
        for depth in range(steps):
            post, pre, k, v = self.step(tokens, hidden, positions, keys, values, depth)
            keys.append(k)
            values.append(v)
            logits.append(self.lm_head(post))
            hidden = _shift_right(pre, 1)
        return logits


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` moved ``n`` positions along the sequence axis (-2), zeros shifted in."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[..., :n, :])
    return torch.cat([pad, x[..., :-n, :]], dim=-2)


def head_config(target_dir: Path, options: Eagle3Options) -> dict[str, Any]:
    """The head's ``config.json`` (vLLM's ``LlamaForCausalLMEagle3``) for a Llama target."""
    t = _read_config(target_dir)
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
            "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")
    config = {k: t[k] for k in keys if k in t}
    # vLLM collects the auxiliary states in layer order whatever order the config names
    # them in, and fc reads them concatenated in that order.
    aux = sorted(set(options.aux_layer_ids or default_aux_layer_ids(int(t["num_hidden_layers"]))))
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        intermediate_size=int(options.intermediate or t["intermediate_size"]),
        tie_word_embeddings=False,
        torch_dtype=options.save_dtype,
        draft_vocab_size=min(options.draft_vocab, int(t["vocab_size"])),
        target_hidden_size=int(t["hidden_size"]),
        eagle_config={"use_aux_hidden_state": True,
                      "eagle_aux_hidden_state_layer_ids": list(aux)},
    )
    return config


# --------------------------------------------------------------------------------------------
# Features.
# --------------------------------------------------------------------------------------------


def response_rows(responses: list[Any], seq_len: int) -> list[tuple[list[int], int]]:
    """(ids, index of the first answer token) per response: the end of a long prompt (at
    most half the row) then the answer, cut to ``seq_len`` (as ``distill`` cuts rows)."""
    rows = []
    for r in responses:
        if not r.response_ids:
            continue
        prompt = r.prompt_ids[-max(1, seq_len // 2):]
        rows.append(((prompt + r.response_ids)[:seq_len], len(prompt)))
    return rows


@torch.no_grad()
def target_features(target: nn.Module, rows: list[tuple[list[int], int]],
                    aux_ids: tuple[int, ...], pad_id: int, *, batch_size: int = 8,
                    progress: bool = True, desc: str = "features",
                    autocast_bf16: bool = False, device: str = "cpu",
                    ) -> dict[str, torch.Tensor]:
    """The target teacher-forced on ``rows``: ``ids`` [N, L] int32, ``lengths``,
    ``answer_start``, ``aux`` [N, L, n_aux * H] and ``final`` [N, L, H] (bfloat16),
    ``greedy`` [N, L] (the target's argmax at each position). ``autocast_bf16`` runs the
    target in bfloat16 (2.3x faster on a CPU with native bfloat16, and what vLLM serves it
    in there). The target runs on ``device`` (where it must be); the features are kept on
    the CPU."""
    from tqdm.auto import tqdm

    width = max(len(ids) for ids, _ in rows)
    n = len(rows)
    h = target.config.hidden_size
    ids_t = torch.full((n, width), pad_id, dtype=torch.int32)
    lengths = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.int32)
    starts = torch.tensor([s for _, s in rows], dtype=torch.int32)
    for i, (ids, _) in enumerate(rows):
        ids_t[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    aux = torch.zeros((n, width, len(aux_ids) * h), dtype=torch.bfloat16)
    final = torch.zeros((n, width, h), dtype=torch.bfloat16)
    greedy = torch.zeros((n, width), dtype=torch.int32)
    lm_head = target.get_output_embeddings().weight
    bar = tqdm(total=n, desc=desc, disable=not progress, unit="row")
    # Rows sorted by length: a batch pads to its own longest row only.
    order = torch.argsort(lengths, descending=True)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        w = int(lengths[idx].max())
        batch_ids = ids_t[idx, :w].long().to(device)
        mask = (torch.arange(w)[None, :] < lengths[idx, None]).long().to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                            enabled=autocast_bf16):
            out = target.model(input_ids=batch_ids, attention_mask=mask,
                               output_hidden_states=True)
            aux[idx, :w] = torch.cat([out.hidden_states[i] for i in aux_ids], -1).to(
                torch.bfloat16).cpu()
            last = out.last_hidden_state
            final[idx, :w] = last.to(torch.bfloat16).cpu()
            greedy[idx, :w] = (last @ lm_head.T).argmax(-1).int().cpu()
        bar.update(len(idx))
    bar.close()
    return {"ids": ids_t, "lengths": lengths, "answer_start": starts, "aux": aux,
            "final": final, "greedy": greedy}


def _cat_features(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(p["ids"].shape[1] for p in parts)

    def pad(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] == width:
            return x
        shape = list(x.shape)
        shape[1] = width - x.shape[1]
        return torch.cat([x, torch.zeros(shape, dtype=x.dtype)], dim=1)

    return {k: torch.cat([pad(p[k]) for p in parts]) for k in parts[0]}


def _load_feature_shard(path: Path, key: str, start: int,
                        count: int) -> dict[str, torch.Tensor] | None:
    """A complete feature shard for the same inputs and rows, else None (computed again)."""
    if not path.is_file():
        return None
    try:
        data = torch.load(path, mmap=True)
    except Exception:  # noqa: BLE001 (a damaged shard is computed again, whatever the damage)
        return None
    if not isinstance(data, dict) or data.get("key") != key or data.get("rows") != [start,
                                                                                      count]:
        return None
    return data["features"]


# --------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------


def ttt_loss_and_hits(head: Eagle3Head, batch: dict[str, torch.Tensor], draft_ids: torch.Tensor,
                      steps: int, decay: float,
                      ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The unrolled loss on one batch of feature rows, and per step (hits, positions) of
    the head's greedy token against the target's greedy token (answer positions only)."""
    ids, lengths = batch["ids"].long(), batch["lengths"].long()
    w = int(lengths.max())
    t = w - 1  # query positions j = 0..w-2 (input token j + 1)
    tokens = ids[:, 1:w]
    aux = batch["aux"][:, :t].to(head.fc.weight.dtype)
    final = batch["final"][:, 1:w].float()  # the teacher at j + 1
    with torch.no_grad():
        teacher = torch.softmax(final @ head.teacher_rows.T, dim=-1)
        greedy_next = batch["greedy"][:, 1:w].long()
        target_in_draft = head.target_to_draft[greedy_next]  # -1 where outside
    logits = head.unroll(tokens, aux, steps)
    j = torch.arange(t, device=ids.device)[None, :]
    # Query j predicts token j + 2; its teacher needs position j + 1 < length.
    has_label = (j + 1) < lengths[:, None]
    answer = (j + 2) >= batch["answer_start"].long()[:, None]
    loss = torch.zeros((), dtype=torch.float32, device=ids.device)
    weight_sum = 0.0
    hits = []
    for depth, lg in enumerate(logits):
        valid = has_label & (j >= depth)
        lp = torch.log_softmax(lg.float(), dim=-1)
        per_pos = -(teacher * lp).sum(-1)
        wgt = decay ** depth
        loss = loss + wgt * (per_pos * valid).sum() / valid.sum().clamp_min(1)
        weight_sum += wgt
        with torch.no_grad():
            pick = lg.argmax(-1)
            scored = valid & answer
            hit = (pick == target_in_draft) & scored
            hits.append((int(hit.sum()), int(scored.sum())))
    return loss / weight_sum, hits


def _attach_vocab(head: Eagle3Head, draft_ids: torch.Tensor, vocab_size: int,
                  target_lm_head: torch.Tensor) -> None:
    """The draft vocabulary's maps and the target's output rows over it (the teacher)."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    head.register_buffer("target_to_draft", t2d, persistent=False)
    head.register_buffer("teacher_rows", target_lm_head[draft_ids].float().clone(),
                         persistent=False)


def build_head(config: dict[str, Any], target: nn.Module, draft_ids: torch.Tensor,
               seed: int) -> Eagle3Head:
    """A new head: seeded random layer; ``lm_head`` and ``norm`` start as the target's output
    layer restricted to the draft vocabulary (so the head starts out speaking the target's
    output space)."""
    torch.manual_seed(seed)
    embed = target.get_input_embeddings().weight.detach()
    head = Eagle3Head(config, embed)
    for p in head.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        out_rows = target.get_output_embeddings().weight.detach()
        head.lm_head.weight.copy_(out_rows[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight.detach())
        head.o_proj.weight.mul_(0.1)
        head.down_proj.weight.mul_(0.1)
    _attach_vocab(head, draft_ids, embed.shape[0], out_rows)
    return head


def export_head(head: Eagle3Head, config: dict[str, Any], draft_ids: torch.Tensor,
                out_dir: Path, save_dtype: str) -> None:
    """The head in vLLM's ``eagle3`` checkpoint format (module doc)."""
    from safetensors.torch import save_file

    dtype = getattr(torch, save_dtype)
    names = {
        "fc": "fc", "input_layernorm": "midlayer.input_layernorm",
        "hidden_norm": "midlayer.hidden_norm",
        "q_proj": "midlayer.self_attn.q_proj", "k_proj": "midlayer.self_attn.k_proj",
        "v_proj": "midlayer.self_attn.v_proj", "o_proj": "midlayer.self_attn.o_proj",
        "post_attention_layernorm": "midlayer.post_attention_layernorm",
        "gate_proj": "midlayer.mlp.gate_proj", "up_proj": "midlayer.mlp.up_proj",
        "down_proj": "midlayer.mlp.down_proj", "norm": "norm", "lm_head": "lm_head",
    }
    tensors = {f"{names[mod]}.weight": getattr(head, mod).weight.detach().to(dtype).cpu()
               .contiguous() for mod in names}
    # vLLM maps draft id i to target id i + d2t[i].
    tensors["d2t"] = (draft_ids.cpu() - torch.arange(len(draft_ids))).to(torch.int64).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.safetensors"):
        stale.unlink()
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def block_efficiency_from_counters(counters: dict[str, Any]) -> dict[str, Any]:
    """Tokens per target forward and first-draft acceptance from vLLM's spec-decode
    counters (``vllm:spec_decode_*``)."""
    drafts = float(counters.get("spec_decode_num_drafts", 0) or 0)
    accepted = float(counters.get("spec_decode_num_accepted_tokens", 0) or 0)
    per_pos = counters.get("spec_decode_num_accepted_tokens_per_pos") or []
    return {
        "rounds": int(drafts),
        "accepted_tokens": int(accepted),
        "block_efficiency": round(1 + accepted / drafts, 4) if drafts else None,
        "first_draft_acceptance": round(per_pos[0] / drafts, 4) if drafts and per_pos else None,
        "acceptance_by_position": [round(a / drafts, 4) for a in per_pos] if drafts else [],
    }


# --------------------------------------------------------------------------------------------
# The pipeline.
# --------------------------------------------------------------------------------------------


@dataclass
class Eagle3Job:
    """What one ``distill-eagle3`` run is asked to do (the inputs besides the options)."""

    target: Path
    prompts: Path
    out_dir: Path
    work_dir: Path
    corpus: list[Path] | None = None
    max_prompts: int | None = None
    engine_args: dict[str, Any] | None = None
    command: str = ""
    heldout_prompts: Path | None = None


class Eagle3Run:
    """One run in progress: the shared data stage through :class:`DistillRun`, then the
    head's stages, each with a completion marker recording its inputs."""

    def __init__(self, job: Eagle3Job, options: Eagle3Options, *, progress: bool = True,
                 log: Callable[[str], None] = _log) -> None:
        self.job, self.options, self.progress, self.log = job, options, progress, log
        # Resolved first: CUDA asked for and absent refuses before any stage starts.
        self.device = resolve_device(options.device)
        self.t_start = time.time()
        self.work = Path(job.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        djob = DistillJob(target=job.target, prompts=job.prompts, out_dir=job.out_dir,
                          work_dir=job.work_dir, max_prompts=job.max_prompts,
                          engine_args=job.engine_args, shape=None, command=job.command,
                          heldout_prompts=job.heldout_prompts)
        self.drun = DistillRun.start(djob, options.distill_options(), progress=progress,
                                     log=log)
        o = options
        data_inputs = self.drun.inputs["data"]
        from vllm_specx.training.distill import _corpus_digest

        features = {"data": data_inputs, "seq_len": o.seq_len,
                    "aux_layer_ids": list(self.config()["eagle_config"][
                        "eagle_aux_hidden_state_layer_ids"]), "autocast": o.autocast,
                    "corpus": [str(c) for c in job.corpus] if job.corpus else None,
                    "corpus_files": _corpus_digest(job.corpus) if job.corpus else None,
                    "corpus_windows": o.corpus_windows if job.corpus else 0}
        vocab = {"features": features, "draft_vocab": o.draft_vocab}
        train = {"vocab": vocab, "config": self.config(), "seed": o.seed,
                 "ttt_steps": o.ttt_steps, "ttt_decay": o.ttt_decay, "steps": o.steps,
                 "batch": o.batch, "lr": o.lr, "weight_decay": o.weight_decay,
                 "grad_clip": o.grad_clip, "min_lr_ratio": o.min_lr_ratio,
                 "eval_every": o.eval_every,
                 "threads": o.threads, "autocast": o.autocast, "save_dtype": o.save_dtype,
                 "output": str(job.out_dir)}
        report = {"train": train, "report_k": list(o.report_k),
                  "report_max_tokens": o.report_max_tokens}
        self.inputs = {"data": data_inputs, "features": features, "vocab": vocab,
                       "train": train, "report": report}
        self.markers = {s: self.work / f"eagle3_{s}.done.json" for s in EAGLE3_STAGES}
        self.markers["data"] = self.drun.markers["data"]
        self.markers["report"] = Path(job.out_dir) / "REPORT.json"
        self._target: nn.Module | None = None

    def config(self) -> dict[str, Any]:
        return head_config(self.job.target, self.options)

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            from vllm_specx.training.distill import load_causal_lm

            self._target = load_causal_lm(self.job.target)
        return self._target

    def done(self, stage: str) -> dict[str, Any] | None:
        if stage == "data":
            return self.drun.done("data")
        info = _stage_done(self.markers[stage], self.inputs[stage], self.log)
        if stage == "train" and info is not None and not (
                Path(self.job.out_dir) / "model.safetensors").is_file():
            return None
        if stage == "train" and info is not None and info.get("stopped_by") == "max_minutes" and (
                self.options.max_minutes is None
                or self.options.max_minutes > info.get("training_minutes", 0)):
            # A larger budget continues the run from its last checkpoint.
            return None
        return info

    def finish(self, stage: str, info: dict[str, Any]) -> None:
        if stage == "data":
            self.drun.finish("data", info)
        else:
            _write_json(self.markers[stage], {**info, "inputs": self.inputs[stage]})

    # -- stages ----------------------------------------------------------------------------

    def run_data(self) -> dict[str, Any]:
        return run_data(self.drun)

    def run_features(self) -> dict[str, Any]:
        from vllm_specx.training.distill import corpus_files, corpus_stream, stream_windows

        o, job = self.options, self.job
        t0 = time.time()
        torch.set_num_threads(o.threads)
        aux_ids = tuple(self.config()["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        pad = self.drun.pad_id
        train_rows = response_rows(self.drun.responses("train"), o.seq_len)
        held_rows = response_rows(self.drun.responses("heldout"), o.seq_len)
        if job.corpus and o.corpus_windows:
            stream = corpus_stream(corpus_files(job.corpus), self.drun.tokenizer,
                                   self.drun.bos_id, self.drun.eos_id)
            windows = stream_windows(stream, o.seq_len, o.corpus_windows, o.seed + 11,
                                     self.drun.bos_id)
            # Raw text: every position is a training position (answer_start 0).
            train_rows += [(w.tolist(), 0) for w in windows]
        self.log(f"distill-eagle3: features: {len(train_rows)} training rows, "
                 f"{len(held_rows)} held-out rows, aux layers {list(aux_ids)}")
        bf16 = autocast_on_device(o.autocast, self.device)
        shard_dir = self.work / "eagle3_feature_shards"
        shard_dir.mkdir(exist_ok=True)
        key = json.dumps(self.inputs["features"], sort_keys=True)
        computed = 0  # positions computed by this run (not loaded from earlier shards)
        parts: dict[str, list[dict[str, torch.Tensor]]] = {"train": [], "heldout": []}
        size = o.feature_shard_rows
        for split, rows in (("train", train_rows), ("heldout", held_rows)):
            for k, start in enumerate(range(0, len(rows), size)):
                # A shard of rows, written whole (temporary name, then renamed): a killed
                # features stage resumes from its last complete shard.
                path = shard_dir / f"{split}-{k:05d}.pt"
                chunk = rows[start:start + size]
                part = _load_feature_shard(path, key, start, len(chunk))
                if part is None:
                    target = self.target.to(self.device)
                    part = target_features(target, chunk, aux_ids, pad, progress=self.progress,
                                           desc=f"features {split} {k + 1}/"
                                           f"{math.ceil(len(rows) / size)}",
                                           autocast_bf16=bf16, device=self.device)
                    tmp = path.with_suffix(".pt.tmp")
                    torch.save({"key": key, "rows": [start, len(chunk)], "features": part},
                               tmp)
                    tmp.replace(path)
                    computed += int(part["lengths"].sum())
                parts[split].append(part)
        if self._target is not None:
            self._target.to("cpu")
        train, held = _cat_features(parts["train"]), _cat_features(parts["heldout"])
        out = self.work / "eagle3_features.pt"
        torch.save({"train": train, "heldout": held}, out.with_suffix(".pt.tmp"))
        out.with_suffix(".pt.tmp").replace(out)
        del parts
        # The assembled file holds every shard: they are only a resume point.
        for shard in shard_dir.glob("*.pt"):
            shard.unlink()
        positions = int(train["lengths"].sum() + held["lengths"].sum())
        seconds = time.time() - t0
        info = {"rows": len(train_rows), "heldout_rows": len(held_rows),
                "positions": positions, "seconds": round(seconds, 1),
                "positions_computed_this_run": computed,
                "positions_per_second": round(computed / max(seconds, 1e-9), 1),
                "extractor": "transformers (teacher-forced, "
                + ("bfloat16 autocast)" if bf16 else "float32)"), "device": self.device}
        self.log(f"distill-eagle3: features: {json.dumps(info)}")
        return info

    def features(self) -> dict[str, dict[str, torch.Tensor]]:
        if not hasattr(self, "_features"):
            # Memory-mapped: ten times the data is gigabytes of hidden states, paged in as
            # the batches read them rather than all at once.
            self._features = torch.load(self.work / "eagle3_features.pt", mmap=True)
        return self._features

    def run_vocab(self) -> dict[str, Any]:
        """Draft vocabulary: the target's most frequent greedy tokens on the training rows
        (then its answer tokens, then by id); coverage of the held-out greedy tokens."""
        cfg = self.config()
        vocab, size = int(cfg["vocab_size"]), int(cfg["draft_vocab_size"])
        feats = self.features()
        tr = feats["train"]
        valid = torch.arange(tr["ids"].shape[1])[None, :] < tr["lengths"][:, None]
        counts = torch.bincount(tr["greedy"][valid].long(), minlength=vocab).double()
        # The text's own tokens break ties among tokens the target never predicted.
        counts += 1e-3 * torch.bincount(tr["ids"][valid].long(), minlength=vocab).double()
        order = torch.sort(-counts, stable=True).indices
        draft_ids = order[:size].sort().values
        torch.save(draft_ids, self.work / "eagle3_draft_ids.pt")
        ho = feats["heldout"]
        j = torch.arange(ho["ids"].shape[1])[None, :]
        answer = (j + 1 >= ho["answer_start"][:, None]) & (j < ho["lengths"][:, None] - 1)
        in_vocab = torch.zeros(vocab, dtype=torch.bool)
        in_vocab[draft_ids] = True
        held_greedy = ho["greedy"][answer].long()
        held_tokens = ho["ids"][(j >= ho["answer_start"][:, None])
                                & (j < ho["lengths"][:, None])].long()
        info = {
            "draft_vocab_size": size, "target_vocab_size": vocab,
            "coverage_heldout_target_greedy": round(float(in_vocab[held_greedy].float().mean()), 4),
            "coverage_heldout_answer_tokens": round(float(in_vocab[held_tokens].float().mean()), 4),
            "heldout_positions": int(held_greedy.numel()),
        }
        self.log(f"distill-eagle3: vocab: {json.dumps(info)}")
        return info

    def run_train(self) -> dict[str, Any]:
        from tqdm.auto import tqdm

        from vllm_specx.training.loop import adamw, lr_multiplier, plan_steps, train_steps

        o, cfg = self.options, self.config()
        t0 = time.time()
        torch.set_num_threads(o.threads)
        draft_ids = torch.load(self.work / "eagle3_draft_ids.pt")
        # Built on the CPU (the same seeded start whatever the device), then moved.
        head = build_head(cfg, self.target, draft_ids, o.seed).to(self.device)
        feats = self.features()
        train, held = feats["train"], feats["heldout"]
        n = int(train["ids"].shape[0])
        plan = plan_steps(n, epochs=max(1, math.ceil(o.steps * o.batch / n)), batch_size=o.batch,
                          max_steps=o.steps, warmup_frac=0.03)
        opt = adamw(head, lr=o.lr, weight_decay=o.weight_decay, betas=(0.9, 0.95),
                    decay_1d=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(plan, o.min_lr_ratio))
        state_file = self.work / "eagle3_train_state.pt"
        step, curve, seconds_before = 0, [], 0.0
        if state_file.is_file():
            state = torch.load(state_file, weights_only=False, map_location="cpu")
            if _without_budget(state["inputs"]) == self.inputs["train"]:
                head.load_state_dict(state["head"], strict=False)
                opt.load_state_dict(state["opt"])
                sched.load_state_dict(state["sched"])
                step, curve, seconds_before = state["step"], state["curve"], state["seconds"]
                self.log(f"distill-eagle3: train: resuming at step {step}")
        autocast = autocast_on_device(o.autocast, self.device)
        positions_per_step = []

        def batch_rows(s: int) -> torch.Tensor:
            # Step s's rows: a pure function of the seed and the step, so a resumed run
            # trains on exactly the rows an uninterrupted one would.
            epoch, k = divmod(s, plan.steps_per_epoch)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(o.seed + 1000
                                                                              + epoch))
            return perm[k * o.batch:(k + 1) * o.batch]

        def evaluate() -> list[float]:
            head.eval()
            hits = [[0, 0] for _ in range(o.ttt_steps)]
            with torch.no_grad():
                for start in range(0, int(held["ids"].shape[0]), 16):
                    rows = slice(start, start + 16)
                    _, h = ttt_loss_and_hits(head, {k: v[rows].to(self.device)
                                                    for k, v in held.items()},
                                             draft_ids, o.ttt_steps, o.ttt_decay)
                    for d, (a, b) in enumerate(h):
                        hits[d][0] += a
                        hits[d][1] += b
            head.train()
            return [round(a / max(1, b), 4) for a, b in hits]

        names = list(train)
        columns = [train[k] for k in names]

        def unrolled_loss(model: nn.Module, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return ttt_loss_and_hits(model, dict(zip(names, rows)), draft_ids, o.ttt_steps,
                                     o.ttt_decay)[0]

        stopped_by = "steps"
        bar = tqdm(total=plan.total, initial=step, desc="train eagle3", disable=not self.progress,
                   unit="step")
        seg_t0 = time.time()
        loss_sum, loss_n = 0.0, 0
        head.train()
        while step < plan.total:
            elapsed = seconds_before + time.time() - seg_t0
            if o.max_minutes is not None and elapsed > 60 * o.max_minutes:
                stopped_by = "max_minutes"
                break
            idx = batch_rows(step)
            # The optimiser step itself is the one every specx trainer takes (loop.py).
            step_loss, rows = train_steps(head, columns, unrolled_loss, [idx], opt, sched,
                                          grad_clip=o.grad_clip, autocast_bf16=autocast,
                                          device=self.device)
            step += 1
            loss_sum += step_loss / rows
            loss_n += 1
            positions_per_step.append(int(train["lengths"][idx].sum()))
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum / loss_n:.3f}")
            if step % o.eval_every == 0 or step == plan.total:
                agreement = evaluate()
                elapsed = seconds_before + time.time() - seg_t0
                trained = (curve[-1]["positions_trained"] if curve else 0) + sum(
                    positions_per_step)
                positions_per_step = []
                curve.append({"step": step, "positions_trained": trained,
                              "minutes": round(elapsed / 60, 2),
                              "train_loss": round(loss_sum / max(1, loss_n), 4),
                              "heldout_agreement_by_step": agreement})
                loss_sum, loss_n = 0.0, 0
                self.log(f"distill-eagle3: train: {json.dumps(curve[-1])}")
                torch.save({"inputs": self.inputs["train"], "head": head.state_dict(),
                            "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step, "curve": curve, "seconds": elapsed},
                           state_file)
        bar.close()
        if not curve or curve[-1]["step"] != step:
            elapsed = seconds_before + time.time() - seg_t0
            trained = (curve[-1]["positions_trained"] if curve else 0) + sum(positions_per_step)
            curve.append({"step": step, "positions_trained": trained,
                          "minutes": round(elapsed / 60, 2),
                          "train_loss": round(loss_sum / max(1, loss_n), 4),
                          "heldout_agreement_by_step": evaluate()})
        export_head(head, cfg, draft_ids, Path(self.job.out_dir), o.save_dtype)
        info = {"steps": step, "planned_steps": plan.total, "stopped_by": stopped_by,
                "batch_rows": o.batch, "training_rows": n,
                "params": sum(p.numel() for p in head.parameters()),
                "positions_trained": curve[-1]["positions_trained"],
                "training_minutes": curve[-1]["minutes"],
                "seconds_this_run": round(time.time() - t0, 1), "curve": curve,
                "autocast_bf16": autocast, "device": self.device}
        self.log(f"distill-eagle3: head written to {self.job.out_dir}")
        return info

    def run_report(self) -> dict[str, Any]:
        """The saved head served by vLLM: plain ``eagle3`` at each K on the held-out
        prompts, greedy, against no speculation."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_specx.bench.engine_run import read_counters
        from vllm_specx.engine import running_llm
        from vllm_specx.training.data import model_summary

        o, job, out = self.options, self.job, Path(self.job.out_dir)
        t0 = time.time()
        held = [r for r in self.drun.responses("heldout") if r.temperature == 0.0]
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in held]
        params = SamplingParams(temperature=0.0, max_tokens=o.report_max_tokens)
        engine = {"max_num_seqs": 16, "torch_threads": o.threads, "disable_log_stats": False,
                  **(job.engine_args or {})}
        engine.pop("max_num_batched_tokens", None)
        vllm_runs: dict[str, Any] = {}
        if o.report_k:
            with running_llm(job.target, **engine) as llm:
                t1 = time.time()
                base = [list(x.outputs[0].token_ids)
                        for x in llm.generate(prompts, params, use_tqdm=False)]
                vllm_runs["no_speculation_seconds"] = round(time.time() - t1, 2)
            for k in o.report_k:
                spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": k}
                # A fresh engine per K: its counters count this generation only.
                with running_llm(job.target, speculative_config=spec, **engine) as llm:
                    t1 = time.time()
                    outs = [list(x.outputs[0].token_ids)
                            for x in llm.generate(prompts, params, use_tqdm=False)]
                    seconds = time.time() - t1
                    counters = read_counters(llm)
                vllm_runs[f"k={k}"] = {
                    **block_efficiency_from_counters(counters),
                    "greedy_equal_to_no_speculation": outs == base,
                    "seconds": round(seconds, 2),
                }
                self.log(f"distill-eagle3: report k={k}: {json.dumps(vllm_runs[f'k={k}'])}")
        train_rec = _stage_done(self.markers["train"]) or {}
        vocab_rec = _stage_done(self.markers["vocab"]) or {}
        feat_rec = _stage_done(self.markers["features"]) or {}
        data_rec = _stage_done(self.markers["data"]) or {}
        for rec in (train_rec, vocab_rec, feat_rec, data_rec):
            rec.pop("inputs", None)
        weights = sorted(out.glob("*.safetensors"))
        curve = train_rec.get("curve") or [{}]
        first = vllm_runs.get(f"k={min(o.report_k)}", {}) if o.report_k else {}
        report = {
            "description": "EAGLE-3 head trained by vllm-specx distill-eagle3 (Li et al., "
            "'EAGLE-3: Scaling up Inference Acceleration of Large Language Models via "
            "Training-Time Test'): one decoder layer on the target's auxiliary hidden states, "
            "trained on the target's own answers with the drafting steps unrolled as vLLM "
            "runs them",
            "command": job.command,
            "target": {k: v for k, v in model_summary(job.target).items() if k != "path"},
            "head": {"draft_vocab_size": self.config()["draft_vocab_size"],
                     "aux_layer_ids": self.config()["eagle_config"][
                         "eagle_aux_hidden_state_layer_ids"],
                     "params": train_rec.get("params"), "saved_dtype": o.save_dtype,
                     "safetensors_bytes": sum(f.stat().st_size for f in weights)},
            "options": o.to_json(),
            "stages": {"data": data_rec, "features": feat_rec, "vocab": vocab_rec,
                       "train": {k: v for k, v in train_rec.items() if k != "curve"}},
            "curve": train_rec.get("curve"),
            "heldout_teacher_forced_agreement_by_step": curve[-1].get(
                "heldout_agreement_by_step"),
            "vllm_first_token_greedy_agreement": first.get("first_draft_acceptance"),
            "vllm_heldout": vllm_runs,
            "vllm_heldout_definition": (
                "the held-out prompts (never trained on) served greedily by the real vLLM "
                "engine with speculative_config {'method': 'eagle3', 'model': <this head>, "
                "'num_speculative_tokens': k}; block_efficiency = 1 + accepted / rounds from "
                "vLLM's spec-decode counters; first_draft_acceptance = rounds whose first "
                "draft was accepted / rounds (the first-token greedy agreement along the "
                "target's own greedy continuation); greedy_equal_to_no_speculation compares "
                "the token ids with the same engine settings without speculation"),
            "report_seconds": round(time.time() - t0, 1),
            "total_seconds_this_run": round(time.time() - self.t_start, 1),
        }
        return report


RUNNERS: dict[str, str] = {"data": "run_data", "features": "run_features",
                           "vocab": "run_vocab", "train": "run_train", "report": "run_report"}


def distill_eagle3(job: Eagle3Job, options: Eagle3Options = Eagle3Options(), *,
                   progress: bool = True, log: Callable[[str], None] = _log,
                   stop_after: str | None = None) -> dict[str, Any]:
    """Run (or resume) the stages of the module doc; returns the last stage's record."""
    options.check()
    run = Eagle3Run(job, options, progress=progress, log=log)
    record: dict[str, Any] = {}
    for stage in EAGLE3_STAGES:
        done = run.done(stage)
        if done is not None:
            log(f"distill-eagle3: stage {stage} done before, skipped")
            record = done
        else:
            record = getattr(run, RUNNERS[stage])()
            run.finish(stage, record)
        if stage == stop_after:
            break
    return record


def _without_budget(train_inputs: dict[str, Any]) -> dict[str, Any]:
    """The train stage's inputs without ``max_minutes``: a budget says when to stop, not
    what is trained (checkpoints written before it left the inputs still carry it), so a
    run stopped by its budget resumes under a larger one."""
    return {k: v for k, v in train_inputs.items() if k != "max_minutes"}
