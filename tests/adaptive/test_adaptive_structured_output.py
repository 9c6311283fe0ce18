"""`adaptive` with vLLM's structured outputs (a JSON schema, JSON mode) in the real V1
engine on the fixture pair, as a user starts it (cost control on).

vLLM's scheduler checks every draft against its request's grammar and cuts it at the
first token the grammar forbids; the target's logits are masked by the grammar at every
verified position. With the cost control the drafts are ragged, zero-length for some
requests on some steps and for every request on others (the draft model's first pass
skipped then): greedy output must still equal no speculation's under the same
constraints, token for token. The lengths come from a fixed cost model and scripted
acceptance (tests/idle_steps.py), not from this host's timings.

Model Runner V2: tests/v2/test_v2_draft_models.py (``test_adaptive_structured_outputs_on_v2``;
V2's grammar-bitmask kernel, which the Triton interpreter cannot run, runs there as the
same arithmetic in torch).
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_requests import STRUCTURED_KINDS, DraftRoundRecorder, counter, structured
from idle_steps import COUNTERS, ScriptedIdleRates, scripted_control

pytestmark = pytest.mark.engine

K = 6
MAX_TOKENS = 40
# Each kind twice, one request each.
KINDS = STRUCTURED_KINDS * 2


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    from vllm_specx.engine import make_llm, running_llm, shutdown_llm
    from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts

    target, draft = (str(p) for p in fixture_model_dirs())
    prompts = [p[:160] for p in heldout_prompts(6)]
    engine_kw = dict(max_model_len=512)
    out: dict[str, Any] = {}
    with running_llm(target, **engine_kw) as llm:
        out["plain"] = [list(o.outputs[0].token_ids) for o in
                        llm.generate(prompts, structured(KINDS, MAX_TOKENS), use_tqdm=False)]
    spec = {"method": "adaptive", "model": draft, "num_speculative_tokens": K}
    llm = make_llm(target, speculative_config=spec, disable_log_stats=False, **engine_kw)
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        drafter = runner.drafter
        assert drafter.settings["cost_control"] is True  # the default
        scripted_control(drafter, K, ScriptedIdleRates(K))
        recorder = DraftRoundRecorder(runner)
        recorder.install()
        before = [counter(llm, c) for c in COUNTERS]
        outputs = llm.generate(prompts, structured(KINDS, MAX_TOKENS), use_tqdm=False)
        out["counts"] = [counter(llm, c) - b for c, b in zip(COUNTERS, before)]
        out["spec"] = [list(o.outputs[0].token_ids) for o in outputs]
        out["texts"] = [o.outputs[0].text for o in outputs]
        out["lengths"] = recorder.rounds
        out["holes"] = dict(drafter.kv_holes().as_dict())
    finally:
        shutdown_llm(llm)
    return out


def test_structured_greedy_output_equals_no_speculation_while_lengths_change(runs):
    assert runs["spec"] == runs["plain"]
    # Both constrained kinds produced JSON-looking text (the grammar reached them).
    assert all(t.lstrip().startswith("{") for t in runs["texts"][:2])
    # Steps of several requests (the JSON-mode ones may close their object in a few
    # tokens and leave the batch early).
    steps = [step for step in runs["lengths"] if len(step) > 1]
    assert any(not any(step) for step in steps), runs["lengths"]  # nobody drafts
    assert any(0 in step and any(step) for step in steps), runs["lengths"]  # only some do
    assert runs["holes"]["skipped_first_passes"] > 0
    drafted, accepted = runs["counts"]
    assert drafted > accepted > 0
