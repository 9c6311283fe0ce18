"""Helpers for MTAD engine tests: tiny models, an in-process engine, draft recording.

The engine gets MTAD exactly as a user does: ``speculative_config={"method": "mtad", ...}``
goes through the config translation and the package's runner hook
(``vllm_specx.glue.runner.install_specx_components``: ``MTADProposer`` + the specx
rejection sampler).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mtad_reference import tiny_llama

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
            out = original(*args, **kwargs)
            n = out.shape[0]
            req_ids = list(self.runner.input_batch.req_ids[:n])
            pos = self.drafter.last_sample_positions.tolist()
            nxt = kwargs["next_token_ids"].tolist()
            q = self.drafter.take_last_draft_probs()
            for i in range(n):
                self.records.append(
                    DraftRecord(
                        req_id=req_ids[i].rsplit("-", 1)[0],
                        position=int(pos[i]),
                        next_token=int(nxt[i]),
                        tokens=out[i].tolist(),
                        q=[] if q is None else q[i].tolist(),
                        num_beams=self.drafter.num_beams,
                    )
                )
            return out

        self.drafter.propose = propose

    def close(self) -> None:
        """Shut the engine down so another one can start in this process."""
        from vllm_specx.testing.engine import shutdown_llm

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
    **llm_kwargs: Any,
) -> Engine:
    """Start a small in-process CPU engine with MTAD drafting (the engine must run in this
    process: the tests read the runner's drafter)."""
    from vllm_specx.testing.engine import make_llm

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
    }
    llm = make_llm(target, speculative_config=spec, **kwargs)
    return Engine(llm)
