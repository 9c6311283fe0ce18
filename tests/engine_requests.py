"""Requests and read-outs shared by the engine tests of the speculative methods
(``tests/adaptive``, ``tests/mtp``, ``tests/eagle``, ``tests/v2``): token-id prompts in,
output ids back in request order, greedy, mixed and structured-output sampling parameters,
vLLM's counters, draft rounds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def counter(llm: Any, name: str) -> float:
    """The sum of vLLM metric ``name`` (e.g. ``vllm:spec_decode_num_draft_tokens``)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def output_ids(outputs: Any) -> list[list[int]]:
    """Each request's generated token ids, in the order the requests were made."""
    return [list(o.outputs[0].token_ids)
            for o in sorted(outputs, key=lambda o: int(o.request_id))]


def greedy(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def mixed(max_tokens: int) -> list[Any]:
    """Greedy and seeded sampled rows in one batch: greedy, top-k/top-p, greedy, T=0.7."""
    from vllm import SamplingParams

    return [
        greedy(max_tokens),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=max_tokens),
        greedy(max_tokens),
        SamplingParams(temperature=0.7, seed=8, max_tokens=max_tokens),
    ]


def generate(llm: Any, prompts: list[list[int]], params: Any) -> Any:
    """``llm.generate`` on token-id prompts."""
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)


# Structured outputs: a JSON schema, JSON mode, and no constraint.
JSON_SCHEMA = {"type": "object",
               "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
               "required": ["name", "count"]}
STRUCTURED_KINDS = ("json_schema", "json_object", "none")


def structured(kinds: Sequence[str], max_tokens: int) -> list[Any]:
    """Greedy SamplingParams, one per entry of ``kinds`` (of :data:`STRUCTURED_KINDS`),
    constrained by :data:`JSON_SCHEMA`, by JSON mode, or not at all."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    by_kind = {"json_schema": StructuredOutputsParams(json=JSON_SCHEMA),
               "json_object": StructuredOutputsParams(json_object=True), "none": None}
    return [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                           structured_outputs=by_kind[kind]) for kind in kinds]


def run_counting_preemptions(llm: Any, run: Callable[[], T]) -> tuple[T, int]:
    """``run()``, and how many times the scheduler preempted a request during it (its
    private ``_preempt_request`` is wrapped for the call and restored afterwards)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    original = sched._preempt_request
    count = 0

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        return original(*args, **kwargs)

    sched._preempt_request = counting
    try:
        return run(), count
    finally:
        sched._preempt_request = original


@dataclass
class DraftRoundRecorder:
    """Wraps the drafter's ``propose`` to record, per round, each request's draft length
    and the ids of the requests drafted for (in the runner's batch order)."""

    runner: Any
    rounds: list[list[int]] = field(default_factory=list)
    req_ids: list[list[str]] = field(default_factory=list)

    def install(self) -> None:
        drafter = self.runner.drafter
        original = drafter.propose

        def propose(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.rounds.append([len(d) for d in out])
            self.req_ids.append(list(self.runner.input_batch.req_ids[: len(out)]))
            return out

        drafter.propose = propose
