"""The V2 test harness itself: the child really runs Model Runner V2 under the Triton
interpreter, and V2 without speculation gives the tokens V1 gives (in this process)."""

from __future__ import annotations

import pytest
from v2_cases import ENGINE_KWARGS, GREEDY, PROMPTS, TARGET

pytestmark = pytest.mark.engine


def test_host_environment_selects_v2(v2_host):
    env = v2_host.env("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")
    assert env == {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    import os

    # The pytest process itself stays on V1: the rest of the suite is not moved.
    assert os.environ.get("TRITON_INTERPRET") != "1"


def test_v1_and_v2_give_the_same_greedy_tokens(v2_reference):
    from vllm_specx.engine import running_llm
    from vllm_specx.testing.v2_engine import describe_runner, generate_token_ids

    with running_llm(TARGET, **ENGINE_KWARGS) as llm:
        assert not describe_runner(llm)["v2"]
        v1 = generate_token_ids(llm, PROMPTS, GREEDY)
    assert [len(t) for t in v1] == [GREEDY["max_tokens"]] * len(PROMPTS)
    assert v1 == v2_reference
