"""Models and engines shared by the end-to-end tests.

Models are built once per session. Engines run in this process
(``vllm_specx.engine``); each is created the first time a test module asks for
it and shut down when that module ends, so no engine outlives the tests that use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from vllm_specx.engine import make_llm, shutdown_llm
from vllm_specx.testing.tiny_models import ModelPair, target_and_draft

# Small token budget per step: prompts longer than this are prefilled in chunks.
MAX_BATCHED_TOKENS = 64
NUM_SPEC = 3


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelPair:
    return target_and_draft(tmp_path_factory.mktemp("tiny_models"), seed=0)


def _engine(model: Any, **kwargs: Any) -> Iterator[Any]:
    llm = make_llm(
        model,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=True,
        disable_log_stats=False,  # spec-decode acceptance counters
        **kwargs,
    )
    try:
        yield llm
    finally:
        shutdown_llm(llm)


@pytest.fixture(scope="module")
def target_llm(models: ModelPair) -> Iterator[Any]:
    yield from _engine(models.target)


@pytest.fixture(scope="module")
def ngram_llm(models: ModelPair) -> Iterator[Any]:
    yield from _engine(
        models.target,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": NUM_SPEC,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )


@pytest.fixture(scope="module")
def draft_llm(models: ModelPair) -> Iterator[Any]:
    yield from _engine(
        models.target,
        speculative_config={
            "method": "draft_model",
            "model": str(models.draft),
            "num_speculative_tokens": NUM_SPEC,
        },
    )
