"""What the method registry (``vllm_specx/methods.py``) decides for the glue, without an
engine: the per-method facts the glue reads from a :class:`MethodSpec` instead of
branching on a method's name."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from vllm_specx.algorithms.beam_tails import beam_tail_span_blocks
from vllm_specx.algorithms.draft_stop import ConfidenceStop
from vllm_specx.glue.ascend import npu_method_refusal
from vllm_specx.glue.beam_kv import beam_scratch_blocks
from vllm_specx.glue.draft_passes import round_stop_rule
from vllm_specx.glue.proposer_contract import SpecxProposer, refuse_unsupported_options
from vllm_specx.methods import METHODS, NpuRefusedSetting


def test_a_rounds_missing_stop_settings_take_the_methods_own_defaults() -> None:
    # specx_mtp's confidence threshold (0.2) is its own, not adaptive's (0.5).
    mtp = round_stop_rule({"method": "specx_mtp", "adaptive": True}, 3, None)
    adaptive = round_stop_rule({"method": "adaptive"}, 3, None)
    assert isinstance(mtp, ConfidenceStop) and isinstance(adaptive, ConfidenceStop)
    assert mtp.threshold == METHODS["specx_mtp"].knob("confidence_threshold").default == 0.2
    assert adaptive.threshold == METHODS["adaptive"].knob("confidence_threshold").default
    assert adaptive.threshold == 0.5
    # The round's K caps min_speculative_tokens; given settings win over defaults.
    rule = round_stop_rule({"method": "adaptive", "min_speculative_tokens": 5,
                            "confidence_threshold": 0.3}, 2, None)
    assert (rule.min_tokens, rule.max_tokens, rule.threshold) == (2, 2, 0.3)


def _beam_engine(method: str, num_beams: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    vllm_config = SimpleNamespace(
        additional_config={"specx": {"method": method, "num_beams": num_beams,
                                     "num_speculative_tokens": 4}},
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        model_config=SimpleNamespace(max_model_len=64),
    )
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=16))
    return vllm_config, SimpleNamespace(kv_cache_groups=[group], num_blocks=400)


def test_beam_scratch_follows_the_specs_beam_width_knob(monkeypatch) -> None:
    # mtad: (B - 1) beams x the blocks a tail can touch x max_num_seqs requests.
    want = 2 * beam_tail_span_blocks(4, 16) * 4
    assert want > 0 and beam_scratch_blocks(*_beam_engine("mtad", 3)) == want
    assert beam_scratch_blocks(*_beam_engine("mtad", 1)) == 0
    # A chain drafter reserves nothing, whatever its settings say.
    assert beam_scratch_blocks(*_beam_engine("adaptive", 3)) == 0
    # A new beam drafter gets the scratch region by naming its width knob.
    monkeypatch.setitem(
        METHODS, "adaptive", dataclasses.replace(METHODS["adaptive"], beam_width_knob="num_beams")
    )
    assert beam_scratch_blocks(*_beam_engine("adaptive", 3)) == want


def test_npu_refusals_come_from_the_spec() -> None:
    spec = METHODS["specx_mtp"]
    assert npu_method_refusal(spec, {"adaptive": False}) is None
    assert 'speculative_config["adaptive"] = true' in npu_method_refusal(spec, {"adaptive": True})
    bare = dataclasses.replace(spec, npu_refused_settings=())
    assert npu_method_refusal(bare, {"adaptive": True}) is None
    extra = dataclasses.replace(
        spec, npu_refused_settings=(NpuRefusedSetting("min_speculative_tokens", 2, "why not"),)
    )
    refusal = npu_method_refusal(extra, {"min_speculative_tokens": 2})
    assert refusal is not None and refusal.endswith("on Ascend NPUs: why not.")


def test_engine_checks_and_proposers_are_named_not_imported() -> None:
    from vllm_specx.glue.mtp_proposer import require_tree_target
    from vllm_specx.glue.patches import require_mtp_layers

    assert [check() for check in METHODS["specx_mtp"].engine_checks] == [
        require_mtp_layers, require_tree_target]
    assert METHODS["adaptive"].engine_checks == () and METHODS["mtad"].engine_checks == ()


@pytest.mark.parametrize(
    "method", sorted(name for name, spec in METHODS.items() if spec.proposer is not None)
)
def test_every_proposer_offers_the_contract(method: str) -> None:
    cls = METHODS[method].proposer()
    for name in ("load_model", "propose", "take_last_draft_probs", "specx_stats"):
        assert callable(getattr(cls, name, None)), (method, name)
    # The contract is checked on an instance (runtime Protocol): without `settings` the
    # runner hook would refuse it.
    instance = object.__new__(cls)
    assert not isinstance(instance, SpecxProposer)
    instance.settings = {"method": method}
    assert isinstance(instance, SpecxProposer)


def test_one_refusal_function_names_every_unsupported_option() -> None:
    def proposer(**flags: bool) -> SimpleNamespace:
        return SimpleNamespace(**{"parallel_drafting": False, "uses_mrope": False, **flags})

    def config() -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1))

    refuse_unsupported_options(proposer(), config(), "x drafting")  # supported: no error
    with pytest.raises(NotImplementedError) as err:
        refuse_unsupported_options(
            proposer(parallel_drafting=True, uses_mrope=True), config(), "x drafting",
            ["its own reason"],
        )
    message = str(err.value)
    assert message.startswith("vllm-specx x drafting does not support: parallel drafting")
    for part in ("M-RoPE", "its own reason"):
        assert part in message
    # (What data parallelism gets is decided with the parallel layouts, not here.)
