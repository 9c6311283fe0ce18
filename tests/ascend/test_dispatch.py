"""Through the fake vLLM-Ascend runner: specx methods get specx proposers and the specx
sampler; vLLM-Ascend's own methods get exactly what they get without vllm-specx."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ascend_configs import ADAPTIVE, MTAD, SPECX_MTP, make_config

from vllm_specx.config import SpecxConfigError
from vllm_specx.glue import ascend as specx_ascend
from vllm_specx.methods import METHODS

# Every branch of get_spec_decode_method at the mirrored commit, with its proposer.
ASCEND_METHODS = {
    "ngram": "AscendNgramProposer",
    "ngram_gpu": "AscendNgramProposerNPU",
    "suffix": "AscendSuffixDecodingProposer",
    "medusa": "AscendMedusaProposer",
    "dspark": "AscendDSparkProposer",
    "eagle": "AscendEagleProposer",
    "eagle3": "AscendEagleProposer",
    "mtp": "AscendEagleProposer",
    "dflash": "AscendDflashProposer",
    "draft_model": "AscendDraftModelProposer",
    "extract_hidden_states": "AscendExtractHiddenStatesProposer",
}
CPU = torch.device("cpu")


@pytest.fixture
def specx_mtp_available(monkeypatch):
    """specx_mtp as it will be once its drafter ships (its NPU side is ours)."""
    monkeypatch.setitem(METHODS, "specx_mtp",
                        dataclasses.replace(METHODS["specx_mtp"], available=True))


def _runner(modules, config):
    return modules["vllm_ascend.worker.model_runner_v1"].NPUModelRunner(config, CPU)


@pytest.mark.parametrize("method", sorted(ASCEND_METHODS))
def test_vllm_ascend_methods_are_untouched(ascend, method: str) -> None:
    runner = _runner(ascend, make_config(method))
    sampler_module = ascend["vllm_ascend.sample.rejection_sampler"]
    assert type(runner.drafter).__name__ == ASCEND_METHODS[method]
    assert type(runner.drafter).__module__.startswith("vllm_ascend.spec_decode")
    assert not hasattr(runner.drafter, "settings")
    assert type(runner.rejection_sampler) is sampler_module.AscendRejectionSampler


def test_step3p5_mtp_still_gets_vllm_ascends_step3p5_proposer(ascend) -> None:
    runner = _runner(ascend, make_config("mtp", step3p5=True))
    assert type(runner.drafter).__name__ == "AscendStep3p5MTPProposer"


def test_unknown_method_still_raises_vllm_ascends_error(ascend) -> None:
    with pytest.raises(ValueError, match="Unknown speculative decoding method: bogus"):
        _runner(ascend, make_config("bogus"))


def test_specx_mtp_gets_the_npu_mtp_proposer_and_the_specx_sampler(
        ascend, specx_mtp_available) -> None:
    runner = _runner(ascend, make_config("mtp", k=3, specx=SPECX_MTP))
    eagle = ascend["vllm_ascend.spec_decode.eagle_proposer"].AscendEagleProposer
    base = ascend["vllm_ascend.spec_decode.llm_base_proposer"].AscendSpecDecodeBaseProposer
    assert type(runner.drafter) is eagle and isinstance(runner.drafter, base)
    assert runner.drafter.settings == SPECX_MTP
    assert runner.drafter.runner is runner
    sampler = runner.rejection_sampler
    ascend_sampler = ascend["vllm_ascend.sample.rejection_sampler"].AscendRejectionSampler
    assert type(sampler).__name__ == "SpecxAscendRejectionSampler"
    assert isinstance(sampler, ascend_sampler)  # vLLM-Ascend's hooks are inherited
    assert sampler.backend.name == "npu" and sampler.rule == "standard"
    assert sampler.sampler is runner.sampler  # vLLM-Ascend's AscendSampler, for the bonus


def test_the_dispatch_builds_whatever_npu_proposer_a_method_names(ascend, monkeypatch) -> None:
    base = ascend["vllm_ascend.spec_decode.llm_base_proposer"].AscendSpecDecodeBaseProposer

    class TestNpuProposer(base):
        def __init__(self, vllm_config, device, runner=None):
            super().__init__(vllm_config, device, True, runner=runner)

    spec = dataclasses.replace(METHODS["mtad"], npu_proposer=lambda: TestNpuProposer)
    monkeypatch.setitem(METHODS, "mtad", spec)
    runner = _runner(ascend, make_config("draft_model", specx=MTAD))
    assert type(runner.drafter) is TestNpuProposer
    assert runner.rejection_sampler.rule == "mtad"
    assert runner.rejection_sampler.acceptance_threshold == pytest.approx(0.1)


@pytest.mark.parametrize("settings", [MTAD, ADAPTIVE], ids=["mtad", "adaptive"])
def test_methods_without_an_npu_drafter_are_refused_in_the_runner_too(ascend, settings) -> None:
    with pytest.raises(SpecxConfigError) as info:
        _runner(ascend, make_config("draft_model", specx=settings))
    message = str(info.value)
    assert "\n" not in message
    assert f'"{settings["method"]}" cannot run on Ascend NPUs yet' in message
    assert "llm_base_proposer.py" in message


def test_the_drafter_must_be_on_the_last_pipeline_stage(
        ascend, specx_mtp_available, monkeypatch) -> None:
    monkeypatch.setattr(specx_ascend, "is_last_pipeline_stage", lambda: False)
    with pytest.raises(SpecxConfigError, match="last pipeline stage"):
        specx_ascend.build_npu_drafter(
            _runner(ascend, make_config("mtp")), dict(SPECX_MTP)
        )


def test_non_last_ranks_build_no_drafter_and_no_sampler_swap(ascend, specx_mtp_available) -> None:
    ascend["vllm_ascend.worker.model_runner_v1"].PP_GROUP.is_last_rank = False
    try:
        runner = _runner(ascend, make_config("mtp", specx=SPECX_MTP))
    finally:
        ascend["vllm_ascend.worker.model_runner_v1"].PP_GROUP.is_last_rank = True
    assert runner.drafter is None and not hasattr(runner, "rejection_sampler")


def test_the_gpu_runner_hook_leaves_vllm_ascends_runner_alone(ascend) -> None:
    runner_cls = ascend["vllm_ascend.worker.model_runner_v1"].NPUModelRunner
    assert specx_ascend.runner_is_ascend(object.__new__(runner_cls))
    assert not specx_ascend.runner_is_ascend(object())
