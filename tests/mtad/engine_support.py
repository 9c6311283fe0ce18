"""Helpers for MTAD engine tests: tiny models, an in-process engine, draft recording.

The engine gets MTAD exactly as a user does: ``speculative_config={"method": "mtad", ...}``
goes through the config translation and the package's runner hook
(``vllm_specx.glue.runner.install_specx_components``: ``MTADProposer`` + the specx
rejection sampler).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mtad_reference import hf_beam_draft, last_logits, tiny_llama

VOCAB = 96


def make_tiny_pair(root: Path) -> tuple[str, str]:
    """A tiny random target (hidden 64) and draft (hidden 32) with one vocabulary."""
    paths = []
    for name, seed, hidden in (("target", 0, 64), ("draft", 1, 32)):
        model = tiny_llama(VOCAB, seed=seed, hidden=hidden)
        out = root / name
        model.save_pretrained(out, safe_serialization=True)
        paths.append(str(out))
    return paths[0], paths[1]


@dataclass
class DraftRecord:
    req_id: str  # external request id
    position: int  # P: the draft continues tokens [0, P]
    next_token: int
    tokens: list[int]
    q: list[float]
    num_beams: int


class Engine:
    """An in-process ``LLM`` with MTAD drafting and a log of every drafted request-round."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.drafter = self.runner.drafter
        self.records: list[DraftRecord] = []
        original = self.drafter.propose

        def propose(*args: Any, **kwargs: Any) -> torch.Tensor:
            result = out = original(*args, **kwargs)
            if isinstance(out, list):  # ragged (cost control): a skipped round has no drafts
                if not any(out):
                    return result
                rows = [list(map(int, r)) for r in out]  # each request its own depth
            else:
                rows = out.tolist()
            n = len(rows)
            req_ids = list(self.runner.input_batch.req_ids[:n])
            pos = self.drafter.last_sample_positions.tolist()
            nxt = kwargs["next_token_ids"].tolist()
            q = self.drafter.take_last_draft_probs()
            for i in range(n):
                if not rows[i]:
                    continue  # a request planned at depth 0 drafted nothing
                self.records.append(
                    DraftRecord(
                        req_id=req_ids[i].rsplit("-", 1)[0],
                        position=int(pos[i]),
                        next_token=int(nxt[i]),
                        tokens=rows[i],
                        q=[] if q is None else q[i, : len(rows[i])].tolist(),
                        num_beams=self.drafter.num_beams,
                    )
                )
            return result

        self.drafter.propose = propose

    def close(self) -> None:
        """Shut the engine down so another one can start in this process."""
        from vllm_specx.engine import shutdown_llm

        if not hasattr(self, "llm"):
            return
        llm = self.llm
        del self.llm, self.runner, self.drafter
        shutdown_llm(llm)

    def count_preemptions(self) -> list[int]:
        """A one-element list counting the scheduler's preemptions from now on."""
        sched = self.llm.llm_engine.engine_core.engine_core.scheduler
        counter = [0]
        original = sched._preempt_request

        def preempt(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return original(*args, **kwargs)

        sched._preempt_request = preempt
        return counter

    def generate(self, prompts: list[list[int]], params: list[Any]) -> dict[str, list[int]]:
        """Run the prompts; return {external request id: prompt + generated tokens}."""
        from vllm.inputs import TokensPrompt

        self.records.clear()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        self.last_outputs = outs
        return {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}


def start_engine(
    target: str,
    draft: str,
    num_speculative_tokens: int,
    num_beams: int,
    acceptance_threshold: float = 0.1,
    spec_extra: dict[str, Any] | None = None,
    **llm_kwargs: Any,
) -> Engine:
    """Start a small in-process CPU engine with MTAD drafting (the engine must run in this
    process: the tests read the runner's drafter)."""
    from vllm_specx.engine import make_llm

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise RuntimeError("MTAD engine tests need VLLM_ENABLE_V1_MULTIPROCESSING=0")
    kwargs: dict[str, Any] = dict(
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=16 * 2**20,
    )
    kwargs.update(llm_kwargs)
    spec = {
        "method": "mtad",
        "model": draft,
        "num_speculative_tokens": num_speculative_tokens,
        "num_beams": num_beams,
        "acceptance_threshold": acceptance_threshold,
        # Greedy rows draft the B-wide beam search here (not the default argmax chain): the
        # tests pin every row's beams against the transformers reference beam search.
        "greedy_drafting": "beam",
        # Every round drafts K, as the reference search does (the default, "greedy", plans
        # the greedy rows' depths): the tests that plan depths turn it on themselves.
        "cost_control": False,
        **(spec_extra or {}),
    }
    llm = make_llm(target, speculative_config=spec, **kwargs)
    return Engine(llm)


@dataclass
class DraftVocab:
    """The id translation between a target and a draft with another tokenizer, built
    from ground truth (the tokenizer rewrite), independently of vLLM's ``VocabMapping``.

    ``to_draft[t]``: draft id of target token t, or ``fallback`` when the draft lacks it
    (vLLM's rule: the draft's unk, else its EOS). ``to_target[d]``: target id of draft
    token d, -1 for draft-only tokens.
    """

    to_draft: torch.Tensor
    to_target: torch.Tensor

    @classmethod
    def from_source_ids(cls, source_id: list[int], target_vocab: int, fallback: int):
        to_target = torch.tensor(source_id)
        to_draft = torch.full((target_vocab,), fallback)
        shared = to_target >= 0
        to_draft[to_target[shared]] = torch.arange(len(source_id))[shared]
        return cls(to_draft=to_draft, to_target=to_target)

    def draft_ids(self, target_ids: list[int]) -> list[int]:
        return self.to_draft[torch.tensor(target_ids, dtype=torch.long)].tolist()

    def target_ids(self, draft_ids: list[int]) -> list[int]:
        out = self.to_target[torch.tensor(draft_ids, dtype=torch.long)].tolist()
        assert -1 not in out, f"a draft-only token was drafted: {draft_ids}"
        return out


class SharedVocabDraft(torch.nn.Module):
    """An HF draft whose logits are restricted to the tokens the target also has."""

    def __init__(self, draft: torch.nn.Module, vocab: DraftVocab) -> None:
        super().__init__()
        self.draft = draft
        self.register_buffer("draft_only", vocab.to_target < 0)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = self.draft(input_ids=input_ids).logits
        return SimpleNamespace(logits=logits.masked_fill(self.draft_only, float("-inf")))


# Greedy replays are deterministic: memoise them (rounds repeat across runs).
_REPLAYS: dict[tuple, tuple[list[int], list[float]]] = {}


def check_rounds_against_reference(
    eng: Engine,
    seqs: dict[str, list[int]],
    prompt_lens: dict[str, int],
    draft: torch.nn.Module,
    warpings: dict[str, Any],
    k: int,
    vocab: DraftVocab | None = None,
) -> tuple[int, int]:
    """Replay every recorded round with the HF drafter.

    Greedy rounds: the HF beam search from the same context must draft the same tokens
    with the same q. Sampled rounds: q_j must be the warped draft probability of the
    drafted token given the context and the beam's own earlier tokens. With ``vocab``
    (a draft with another tokenizer; ``draft`` then restricted to the shared tokens) the
    context is translated into draft ids and the drafts back into target ids.

    Rounds of a partially prefilled prompt are skipped: vLLM drafts for them with a
    placeholder next token and discards the drafts. Returns (checked, skipped partial).
    """
    to_draft = vocab.draft_ids if vocab is not None else list
    to_target = vocab.target_ids if vocab is not None else list
    checked = partial = 0
    for rec in eng.records:
        seq = seqs[rec.req_id]
        if rec.position < prompt_lens[rec.req_id]:
            partial += 1
            continue
        if rec.position + 1 > len(seq):
            continue  # a round after the request's last kept token
        assert seq[rec.position] == rec.next_token, rec
        context = to_draft(seq[: rec.position + 1])
        w = warpings[rec.req_id]
        assert len(rec.tokens) == k and len(rec.q) == k
        if w.greedy:
            key = (id(draft), tuple(context), rec.num_beams, k)
            if key not in _REPLAYS:
                _REPLAYS[key] = hf_beam_draft(draft, context, rec.num_beams, k, w)
            want, want_q = _REPLAYS[key]
            assert rec.tokens == to_target(want), (rec, want)
            assert rec.q == pytest.approx(want_q, rel=1e-3, abs=1e-5)
        else:
            drafted = to_draft(rec.tokens)
            want_q = []
            for j, t in enumerate(drafted):
                ids = torch.tensor([context + drafted[:j]])
                want_q.append(math.exp(float(w.logprobs(last_logits(draft, ids))[0, t])))
            assert rec.q == pytest.approx(want_q, rel=1e-3, abs=1e-5)
            assert all(x > 0 for x in rec.q)
        checked += 1
    return checked, partial
