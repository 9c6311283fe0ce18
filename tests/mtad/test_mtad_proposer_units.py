"""Engine-free pieces of the in-vLLM MTAD drafter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_specx.glue.mtad_proposer import MTADDraftStats, MTADProposer
from vllm_specx.glue.patches import specx_settings
from vllm_specx.methods import METHODS

# The beam tails' visiting order, reuse and pass splitting are pure algorithm now:
# tests/algorithms/test_beam_tails.py.


def test_settings_come_from_additional_config():
    cfg = SimpleNamespace(additional_config={"specx": {"method": "mtad", "num_beams": 8}})
    assert specx_settings(cfg)["num_beams"] == 8
    assert specx_settings(SimpleNamespace(additional_config=None)) is None


def test_proposer_reads_the_validated_settings_and_applies_no_default():
    assert METHODS["mtad"].proposer() is MTADProposer
    proposer = object.__new__(MTADProposer)  # no engine: only the settings plumbing
    proposer.settings = {"method": "mtad", "num_beams": 8, "acceptance_threshold": 0.1}
    assert proposer.num_beams == 8
    proposer.num_beams = 3  # sweeps on a running engine
    assert proposer.settings["num_beams"] == 3 and proposer.num_beams == 3
    proposer.settings = {"method": "mtad"}  # unvalidated: no silent default
    with pytest.raises(KeyError):
        _ = proposer.num_beams


def test_default_control_weighs_sampled_batches_and_greedy_only_all_greedy_ones():
    """mtad's validated default (``"cost_control": true``) weighs every batch, one with a
    sampled request too; ``"greedy"`` only a batch whose requests are all greedy (read from
    V1's ``input_batch.greedy_reqs``). With false there is no control to ask."""
    # The value the validation fills in (tests/glue/test_config_validation.py checks it).
    default = {"method": "mtad", "cost_control": METHODS["mtad"].knob("cost_control").default}
    proposer = object.__new__(MTADProposer)
    proposer.model_runner = SimpleNamespace(input_batch=SimpleNamespace(greedy_reqs={"g"}))
    mixed, greedy = ("g", "s"), ("g",)
    proposer.settings = default
    assert proposer.controls_batch(mixed) and proposer.controls_batch(greedy)
    proposer.settings = {**default, "cost_control": "greedy"}
    assert not proposer.controls_batch(mixed) and proposer.controls_batch(greedy)
    proposer.model_runner = SimpleNamespace()  # a runner that does not say: sampled
    assert not proposer.controls_batch(greedy)


def fake_proposer(**flags):
    base = dict(use_heterogeneous_vocab=False, parallel_drafting=False, uses_mrope=False)
    base.update(flags)
    return SimpleNamespace(**base)


def parallel(dp=1, dcp=1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp, decode_context_parallel_size=dcp)
    )


def test_unsupported_setups_are_refused_with_reasons():
    MTADProposer._refuse_unsupported(fake_proposer(), parallel())  # supported: no error
    # A draft with another tokenizer is supported (test_mtad_hetero_vocab.py).
    MTADProposer._refuse_unsupported(fake_proposer(use_heterogeneous_vocab=True), parallel())
    # Data parallelism is decided before start (glue/parallelism.py, tests/parallel): a
    # dense target's DP ranks are independent engines, so the drafter has nothing to refuse.
    MTADProposer._refuse_unsupported(fake_proposer(), parallel(dp=2))
    with pytest.raises(NotImplementedError, match="parallel drafting"):
        MTADProposer._refuse_unsupported(fake_proposer(parallel_drafting=True), parallel())


def test_stats_full_recompute_formula():
    s = MTADDraftStats()
    s.record(num_reqs=3, k=4, b=8, first=20, tail=50, passes=24)
    s.record(num_reqs=2, k=4, b=8, first=10, tail=40, passes=24)
    d = s.as_dict()
    assert d["requests"] == 5 and d["rounds"] == 2
    assert d["full_recompute_tail_tokens"] == 5 * 8 * 4 * 3 // 2
    assert d["tail_tokens"] == 90 and d["first_pass_tokens"] == 30
