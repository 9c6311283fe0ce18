"""What the method registry (``vllm_specx/methods.py``) decides for the glue, without an
engine: the per-method facts the glue reads from a :class:`MethodSpec` instead of
branching on a method's name."""

from __future__ import annotations

from vllm_specx.algorithms.draft_stop import ConfidenceStop
from vllm_specx.glue.draft_passes import round_stop_rule
from vllm_specx.methods import METHODS


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
