"""Reference MTAD over Hugging Face models (tests only; slow and obviously correct).

* Drafting: ``vllm_specx.algorithms.beam_draft`` driven by a ``transformers`` draft model
  that recomputes the whole sequence (no KV cache) for every beam at every step, so there
  is no cache bookkeeping to get wrong.
* Verification: the joint-likelihood rule of MTAD (Qin et al., "Optimized Multi-Token
  Joint Decoding with Auxiliary Model for LLM Inference") written as a plain loop:
  ``S_i = sum_{j<=i} log p_j(x_j) - log q_j(x_j)``; accept the LARGEST depth with
  ``S_i > log(tau)``; then one extra token from ``p_{a+1}``. Greedy requests (temperature
  0) use greedy verification: accept while ``x_i == argmax p_i``, then emit the argmax.

It proves the in-vLLM drafter later: for greedy requests the beam search is deterministic,
so the drafts vLLM's ``MTADProposer`` makes from a context must equal ``hf_beam_draft`` on
the same context (up to float rounding on near-ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vllm_specx.algorithms.beam_draft import beam_search, warp_logprobs


@dataclass
class Warping:
    """A request's sampling parameters (vLLM's meaning; temperature 0 = greedy)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped log-probs of [N, V] logits (greedy: plain log-softmax)."""
        n = logits.shape[0]
        return warp_logprobs(
            logits,
            torch.full((n,), float(self.temperature)),
            torch.full((n,), int(self.top_k)),
            torch.full((n,), float(self.top_p)),
        )


@torch.no_grad()
def last_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits at the last position of every row of ``input_ids`` [N, L] -> [N, V] float32."""
    return model(input_ids=input_ids).logits[:, -1, :].float()


@torch.no_grad()
def hf_beam_draft(
    draft: torch.nn.Module,
    context: list[int],
    num_beams: int,
    depth: int,
    warping: Warping,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """Best beam of a width-``num_beams``, depth-``depth`` search from ``context``.

    Returns (tokens, q) with q_j the draft's warped probability of token j on that beam.
    """
    prefix = torch.tensor(context, dtype=torch.long)

    def next_logprobs(tokens: torch.Tensor) -> torch.Tensor:  # [1, width, d]
        width = tokens.shape[1]
        ids = torch.cat([prefix.expand(width, -1), tokens[0]], dim=1)
        return warping.logprobs(last_logits(draft, ids)).unsqueeze(0)

    greedy = torch.tensor([warping.greedy])
    gens = None if generator is None else {0: generator}
    tokens, q, _ = beam_search(next_logprobs, 1, num_beams, depth, greedy, gens)
    return tokens[0].tolist(), q[0].tolist()


def joint_accept_length(
    target_logprobs: list[float], draft_q: list[float], acceptance_threshold: float
) -> int:
    """MTAD's rule for one request: the largest i with sum_{j<=i}(log p_j - log q_j) >
    log(tau), 0 if none. ``target_logprobs[j]`` = log p_j(x_j)."""
    log_tau = math.log(acceptance_threshold)
    s, best = 0.0, 0
    for i, (lp, q) in enumerate(zip(target_logprobs, draft_q), start=1):
        s += lp - (math.log(q) if q > 0 else float("inf"))
        if s > log_tau:
            best = i
    return best


@dataclass
class Round:
    draft: list[int]
    q: list[float]
    accepted: int
    extra: int


@dataclass
class MTADResult:
    tokens: list[int]  # generated tokens (the prompt excluded)
    rounds: list[Round] = field(default_factory=list)

    @property
    def target_passes(self) -> int:
        return len(self.rounds)

    @property
    def block_efficiency(self) -> float:
        """Tokens emitted per target forward pass (accepted drafts + the extra token)."""
        return sum(r.accepted + 1 for r in self.rounds) / max(1, len(self.rounds))


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def mtad_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    num_speculative_tokens: int,
    num_beams: int,
    acceptance_threshold: float,
    warping: Warping,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> MTADResult:
    """MTAD decoding, one request, one target forward pass per round."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    seq = list(prompt)
    out = MTADResult(tokens=[])
    while len(out.tokens) < max_new_tokens:
        k = num_speculative_tokens
        draft_tokens, q = hf_beam_draft(draft, seq, num_beams, k, warping, gen)
        ids = torch.tensor([seq + draft_tokens])
        logits = target(input_ids=ids).logits[0, len(seq) - 1 :].float()  # [k + 1, V]
        if warping.greedy:
            best = logits.argmax(-1).tolist()
            a = 0
            while a < k and draft_tokens[a] == best[a]:
                a += 1
            extra = best[a]
        else:
            logp = warping.logprobs(logits)
            lp = [float(logp[j, t]) for j, t in enumerate(draft_tokens)]
            a = joint_accept_length(lp, q, acceptance_threshold)
            extra = _sample(logp[a].exp(), gen)
        out.rounds.append(Round(draft_tokens, q, a, extra))
        new = draft_tokens[:a] + [extra]
        for t in new:
            if len(out.tokens) >= max_new_tokens:
                break
            out.tokens.append(t)
            seq.append(t)
            if eos_token_id is not None and t == eos_token_id:
                return out
    return out


@torch.no_grad()
def greedy_generate(target: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with the target (what greedy MTAD must reproduce)."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(last_logits(target, torch.tensor([seq])).argmax(-1)))
    return seq[len(prompt) :]


def tiny_llama(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2):
    """A tiny random ``LlamaForCausalLM`` (float32, eval mode) for reference tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Random init logits are nearly flat; sharpen them so drafts and targets have
    # structure (and so target and draft can agree sometimes).
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model
