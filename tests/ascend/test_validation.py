"""Refusals before the engine starts on NPU (NPUPlatform.check_and_update_config, as
patched): one line each, naming the key, the value and what is allowed or why."""

from __future__ import annotations

import dataclasses

import pytest
from ascend_configs import ADAPTIVE, MTAD, SPECX_MTP, make_config
from vllm.config import CUDAGraphMode

from vllm_specx.config import SpecxConfigError
from vllm_specx.glue.ascend import capture_size_refusal
from vllm_specx.methods import METHODS
from vllm_specx.version_gate import vllm_ascend_pair_note


@pytest.fixture
def specx_mtp_available(monkeypatch):
    monkeypatch.setitem(METHODS, "specx_mtp",
                        dataclasses.replace(METHODS["specx_mtp"], available=True))


def _check(modules, config) -> None:
    modules["vllm_ascend.platform"].NPUPlatform.check_and_update_config(config)


def _refusal(modules, config) -> str:
    with pytest.raises(SpecxConfigError) as info:
        _check(modules, config)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("settings", [MTAD, ADAPTIVE], ids=["mtad", "adaptive"])
def test_methods_without_an_npu_drafter_are_refused_with_the_reason(
        ascend, specx_mtp_available, settings) -> None:
    message = _refusal(ascend, make_config("draft_model", specx=settings))
    assert message.startswith(f'speculative_config["method"] = "{settings["method"]}" cannot '
                              "run on Ascend NPUs yet")
    assert "vLLM's GPU proposer" in message
    assert "specx methods that run on NPU: specx_mtp" in message


def test_an_unavailable_method_says_so(ascend, monkeypatch) -> None:
    monkeypatch.setitem(METHODS, "specx_mtp",
                        dataclasses.replace(METHODS["specx_mtp"], available=False))
    message = _refusal(ascend, make_config("mtp", specx=SPECX_MTP))
    assert "is not available yet" in message


def test_specx_mtp_passes_and_vllm_methods_are_not_checked(ascend, specx_mtp_available) -> None:
    _check(ascend, make_config("mtp", specx=SPECX_MTP))
    # vLLM-Ascend's own method with settings specx would refuse: not specx's business.
    _check(ascend, make_config("mtp", k=3, additional={"enable_reduce_sample": True},
                               cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY,
                               capture_sizes=[1, 2, 5]))


def test_adaptive_stop_of_specx_mtp_is_refused_on_npu(ascend, specx_mtp_available) -> None:
    message = _refusal(ascend, make_config("mtp", specx={**SPECX_MTP, "adaptive": True}))
    assert message.startswith('speculative_config["adaptive"] = true is not allowed with method '
                              '"specx_mtp" on Ascend NPUs')


@pytest.mark.parametrize("additional, key", [
    ({"enable_reduce_sample": True}, 'additional_config["enable_reduce_sample"] = true'),
    ({"rejection_sampler_config": {"enable_block_verify": True}}, '["enable_block_verify"]'),
    ({"rejection_sampler_config": {"enable_entropy_verify": True}}, '["enable_entropy_verify"]'),
])
def test_vllm_ascend_settings_that_replace_verification_are_refused(
        ascend, specx_mtp_available, additional, key) -> None:
    message = _refusal(ascend, make_config("mtp", specx=SPECX_MTP, additional=additional))
    assert key in message and "specx" in message


def test_310p_and_runner_v2_are_refused(ascend, specx_mtp_available, monkeypatch) -> None:
    assert "V1 NPU runner only" in _refusal(ascend, make_config("mtp", specx=SPECX_MTP, v2=True))
    monkeypatch.setattr(ascend["vllm_ascend.utils"], "FAKE_IS_310P", True)
    assert "310P" in _refusal(ascend, make_config("mtp", specx=SPECX_MTP))


def test_step3p5_mtp_is_refused_for_specx_mtp(ascend, specx_mtp_available) -> None:
    assert "step3p5" in _refusal(ascend, make_config("mtp", specx=SPECX_MTP, step3p5=True))


def test_full_graph_capture_sizes_must_be_multiples_of_k_plus_1(
        ascend, specx_mtp_available) -> None:
    full = CUDAGraphMode.FULL_DECODE_ONLY
    message = _refusal(ascend, make_config("mtp", k=2, specx=SPECX_MTP, cudagraph_mode=full,
                                           capture_sizes=[1, 3, 4, 8, 12]))
    assert message.startswith("compilation_config.cudagraph_capture_sizes = [1, 3, 4, 8, 12]")
    assert "multiple of num_speculative_tokens + 1 = 3" in message
    assert "1 -> 3, 4 -> 3, 8 -> 9" in message and "e.g. [3, 9, 12]" in message
    # Valid sizes pass; piecewise graphs and eager mode have no such limit.
    _check(ascend, make_config("mtp", k=2, specx=SPECX_MTP, cudagraph_mode=full,
                               capture_sizes=[3, 6, 48]))
    _check(ascend, make_config("mtp", k=2, specx=SPECX_MTP, capture_sizes=[1, 2, 4]))
    _check(ascend, make_config("mtp", k=2, specx=SPECX_MTP, cudagraph_mode=full,
                               capture_sizes=[1, 2, 4], enforce_eager=True))


def test_capture_size_refusal_arithmetic() -> None:
    assert capture_size_refusal([2, 4, 6], 1) is None
    assert capture_size_refusal(None, 3) is None
    message = capture_size_refusal([5, 7, 16], 3)  # step 4: 5 -> 4, 7 -> 8 (tie: lower)
    assert message is not None and "5 -> 4, 7 -> 8" in message and "e.g. [4, 8, 16]" in message
    tie = capture_size_refusal([6], 3)  # 6 is 2 from 4 and 2 from 8: the lower one
    assert tie is not None and "6 -> 4" in tie


def test_pair_note_says_what_is_installed_and_what_it_was_written_against() -> None:
    note = vllm_ascend_pair_note("0.27.1rc1", "0.32.0")
    assert note is not None and "\n" not in note
    assert "vllm-ascend main@182b75ea84" in note and "tracking vLLM 0.27.1" in note
    assert "installed: vLLM-Ascend 0.27.1rc1 with vLLM 0.32.0" in note
    assert "made for vLLM 0.27.1, not 0.32.0" in note
    same = vllm_ascend_pair_note("0.32.0rc1", "0.32.0")
    assert same is not None and "made for" not in same and "unverified" in same


@pytest.mark.parametrize("tree, size", [
    ({"max_nodes": 8, "max_depth": 3, "branching": 2}, "within that limit"),
    (True, "over that limit"),
])
def test_a_draft_tree_is_refused_on_npu_with_the_reason(
        ascend, specx_mtp_available, tree, size) -> None:
    """Issue 34 item 4: the tree mask is not routed into vLLM-Ascend's attention, and
    npu_fused_infer_attention_score verifies at most 16 query tokens per request: one
    line that says both, with this tree's size against that limit."""
    message = _refusal(ascend, make_config("mtp", specx={**SPECX_MTP, "draft_tree": tree}))
    assert message.startswith('speculative_config["draft_tree"] = ')
    assert 'with method "specx_mtp" on Ascend NPUs yet' in message
    assert "npu_fused_infer_attention_score" in message
    assert "tree size + 1 <= 16" in message and size in message, message
    # The same config without the tree passes.
    _check(ascend, make_config("mtp", specx={**SPECX_MTP, "draft_tree": False}))
