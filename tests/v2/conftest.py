"""Model Runner V2 on the CPU platform: one child process hosts every V2 engine.

How to use (vllm_specx/testing/v2_engine.py says why a child process):

* ``v2_host`` (session): the :class:`~vllm_specx.testing.v2_engine.V2EngineHost`.
  ``v2_host.start(key, model, speculative_config=..., **engine_kwargs)`` builds an
  engine once (returns which runner / speculator / sampler it built: assert ``"v2"``),
  ``v2_host.generate(key, prompts, sampling)`` returns token ids,
  ``v2_host.call(key, "module:function", *args)`` runs ``function(llm, *args)`` there,
  ``v2_host.stop(key)`` frees it. Run ONE engine at a time: stopping an engine tears
  down vLLM's process-wide parallel state (``pipeline model parallel group is not
  initialized`` in any engine still running), so stop the others before starting
  one (``v2_reference`` starts and stops one too). Start each configuration once per
  module (module-scoped fixtures), stop it at module end: the interpreter is ~10x
  slower.
* ``v2_engine(key, model, **kwargs)``: a factory fixture for module fixtures that
  starts an engine, asserts it runs on V2, and stops it at module end.
* ``v2_reference``: greedy token ids of the fixture target without speculation on V2
  for ``v2_cases.PROMPTS`` (session-cached), the baseline of every greedy-equality test.
* ``v2_cases.py`` (``from v2_cases import ...``): the models, :data:`PROMPTS`,
  :data:`GREEDY` and :data:`ENGINE_KWARGS`, the engine settings every V2 test engine
  shares (chunked prefill at 64 tokens, prefix caching): outputs compare across tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from v2_cases import (  # noqa: E402
    ENGINE_KWARGS,
    GREEDY,
    PROMPTS,
    STRUCTURED_MAX_TOKENS,
    TARGET,
    heldout_prompts,
)

from vllm_specx.testing.v2_engine import V2EngineHost


@pytest.fixture(scope="session")
def v2_host() -> Iterator[V2EngineHost]:
    host = V2EngineHost()
    try:
        yield host
    finally:
        host.close()


@pytest.fixture(scope="module")
def v2_engine(v2_host: V2EngineHost) -> Iterator[Callable[..., dict[str, Any]]]:
    started: list[str] = []

    def start(key: str, model: str = TARGET, **kwargs: Any) -> dict[str, Any]:
        if key in v2_host.running:
            return v2_host.running[key]
        description = v2_host.start(key, model, **{**ENGINE_KWARGS, **kwargs})
        started.append(key)
        assert description["v2"], f"{key} did not run on Model Runner V2: {description}"
        return description

    yield start
    for key in started:
        if key in v2_host.running:  # a test may stop its engine early
            v2_host.stop(key)


@pytest.fixture(scope="session")
def v2_references(v2_host: V2EngineHost) -> dict[str, Any]:
    """Greedy outputs of the fixture target, no speculation, on V2 (engine stopped after):
    for PROMPTS, for the held-out prompts, and for PROMPTS under structured outputs
    (``v2_cases.generate_structured``), one engine."""
    description = v2_host.start("reference", TARGET, **ENGINE_KWARGS)
    try:
        assert description["v2"], description
        out: dict[str, Any] = {
            "prompts": v2_host.generate("reference", PROMPTS, GREEDY),
            "heldout": v2_host.generate("reference", heldout_prompts(), GREEDY)}
        try:
            out["structured"] = v2_host.call("reference", "v2_cases:generate_structured",
                                             STRUCTURED_MAX_TOKENS)
        except Exception as exc:  # only the structured-output test fails for it
            out["structured"] = exc
        return out
    finally:
        v2_host.stop("reference")


@pytest.fixture(scope="session")
def v2_reference(v2_references: dict[str, Any]) -> list[list[int]]:
    """Greedy outputs for ``v2_cases.PROMPTS`` without speculation on V2."""
    return v2_references["prompts"]


@pytest.fixture(scope="session")
def v2_structured_reference(v2_references: dict[str, Any]) -> list[list[int]]:
    """Greedy outputs for ``v2_cases.PROMPTS`` under each structured-output kind without
    speculation on V2 (``v2_cases.generate_structured``)."""
    structured = v2_references["structured"]
    if isinstance(structured, Exception):
        raise structured
    return structured


@pytest.fixture(scope="session")
def v2_heldout_reference(v2_references: dict[str, Any]) -> list[list[int]]:
    """Greedy outputs for ``v2_cases.heldout_prompts()`` without speculation on V2."""
    return v2_references["heldout"]
