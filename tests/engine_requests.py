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


def spec_counts(llm: Any, run: Callable[[], T]) -> tuple[T, int, int]:
    """``run()``'s result, and the draft tokens drafted and accepted during it, from this
    engine's own per-step spec-decode stats (the engine needs ``disable_log_stats=False``).
    Not from ``llm.get_metrics()``: vLLM's Prometheus registry is process-wide, and every
    engine started later (another fixture of this process) unregisters the collectors of
    the engines before it."""
    manager = llm.llm_engine.logger_manager
    record = manager.record
    counts = [0, 0]

    def counting_record(scheduler_stats: Any, *args: Any, **kwargs: Any) -> Any:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is not None:
            counts[0] += spec.num_draft_tokens
            counts[1] += spec.num_accepted_tokens
        return record(scheduler_stats, *args, **kwargs)

    manager.record = counting_record
    try:
        result = run()
    finally:
        del manager.record
    return result, counts[0], counts[1]


# Per-request parameters a server's batch mixes (tests/engine/test_per_request_params.py,
# tests/v2/test_v2_per_request_params.py), as SamplingParams keyword dicts. The allowed
# tokens stay under Model Runner V2's own limit (1024 ids a request).
PER_REQUEST_ALLOWED = range(30, 1000)
PER_REQUEST_MIN_TOKENS = 10
# Rows of per_request_greedy's list (the tests read their outputs by these).
PER_REQUEST_LOGPROBS_ROW = 2
PER_REQUEST_MIN_TOKENS_ROW = 3
PER_REQUEST_ALLOWED_ROW = 4
PER_REQUEST_ONE_TOKEN_ROW = 5


def per_request_greedy(max_tokens: int, stop_token: int) -> list[dict[str, Any]]:
    """Greedy requests with penalties, logprobs (and prompt logprobs), ``min_tokens`` held
    against ``stop_token`` (choose one the request's plain greedy output emits early), an
    allowed-token list, and one token only."""
    base = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    return [
        {**base, "repetition_penalty": 1.3},
        {**base, "presence_penalty": 1.5, "frequency_penalty": 0.7},
        {**base, "logprobs": 5, "prompt_logprobs": 2},
        {"temperature": 0.0, "max_tokens": max_tokens, "min_tokens": PER_REQUEST_MIN_TOKENS,
         "stop_token_ids": [stop_token]},
        {**base, "allowed_token_ids": list(PER_REQUEST_ALLOWED)},
        {**base, "max_tokens": 1},
    ]



def per_request_stop_token(free: Sequence[Sequence[int]]) -> int:
    """The stop token for :func:`per_request_greedy`: the third token of the ``min_tokens``
    request's greedy output without parameters (``free``, one row per prompt)."""
    return int(free[PER_REQUEST_MIN_TOKENS_ROW][2])


def check_per_request_greedy(ids: Sequence[Sequence[int]], free: Sequence[Sequence[int]],
                             stop_token: int) -> None:
    """Asserts that :func:`per_request_greedy`'s parameters held in its outputs ``ids``: the
    stop token came third without ``min_tokens`` and not before the minimum with it, only
    allowed tokens, one token where one was asked for."""
    row = PER_REQUEST_MIN_TOKENS_ROW
    assert stop_token in free[row][:3]
    assert len(ids[row]) >= PER_REQUEST_MIN_TOKENS
    assert stop_token not in ids[row][:PER_REQUEST_MIN_TOKENS]
    assert all(t in PER_REQUEST_ALLOWED for t in ids[PER_REQUEST_ALLOWED_ROW])
    assert len(ids[PER_REQUEST_ONE_TOKEN_ROW]) == 1


def per_request_sampled(max_tokens: int) -> list[dict[str, Any]]:
    """Sampled requests: top-k 1 at T = 1 (it draws the argmax: the plain greedy output),
    ``n`` = 3, a tiny top-p, and penalties with logprobs."""
    base = {"max_tokens": max_tokens, "ignore_eos": True}
    return [
        {**base, "temperature": 1.0, "top_k": 1, "seed": 2},
        {**base, "temperature": 1.0, "seed": 4, "n": 3},
        {**base, "temperature": 1.2, "top_p": 0.05, "seed": 3},
        {**base, "temperature": 0.7, "seed": 7, "repetition_penalty": 1.2, "logprobs": 3},
    ]


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
