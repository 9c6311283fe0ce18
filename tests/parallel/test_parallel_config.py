"""Parallel layouts at engine-config time (no engine started): what each specx method is
allowed under tensor / data / pipeline parallelism, refused in ONE line before start
(``vllm_specx/glue/parallelism.py``; docs/scaling-out.md).

Built through vLLM's own ``EngineArgs.create_engine_config`` on the fixture models: the
fixture pair's Llama target is dense; the MTP fixture (DeepSeek-V3, 4 routed experts) is a
mixture-of-experts model to vLLM (``ModelConfig.is_moe``), so its data-parallel ranks would
run in lockstep.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_specx.config import SPECX_CONFIG_KEY, SpecxConfigError
from vllm_specx.fixtures import fixture_model_dirs, fixtures_root

DRAFT_METHODS = [
    {"method": "mtad", "num_speculative_tokens": 3, "num_beams": 2},
    {"method": "adaptive", "num_speculative_tokens": 4},
]
MTP_SPEC = {"method": "specx_mtp", "num_speculative_tokens": 2, "adaptive": True}


def engine_config(model: Any, spec: dict[str, Any], **parallel: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32",
                      speculative_config=dict(spec), **parallel).create_engine_config()


def pair_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "model": str(fixture_model_dirs()[1])}


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("spec", DRAFT_METHODS, ids=lambda s: s["method"])
def test_dense_target_under_data_parallel_is_allowed(spec):
    """vLLM runs each DP rank of a dense target as its own engine: nothing to refuse."""
    cfg = engine_config(fixture_model_dirs()[0], pair_spec(spec), data_parallel_size=2)
    assert cfg.parallel_config.data_parallel_size == 2
    assert cfg.model_config.is_moe is False
    assert cfg.additional_config[SPECX_CONFIG_KEY]["method"] == spec["method"]


@pytest.mark.parametrize("spec", DRAFT_METHODS, ids=lambda s: s["method"])
@pytest.mark.parametrize("draft_tp", [None, 2])
def test_tensor_parallel_with_the_draft_at_the_target_size_is_allowed(spec, draft_tp):
    given = pair_spec(spec)
    if draft_tp is not None:
        given["draft_tensor_parallel_size"] = draft_tp
    cfg = engine_config(fixture_model_dirs()[0], given, tensor_parallel_size=2)
    assert cfg.speculative_config.draft_parallel_config.tensor_parallel_size == 2


@pytest.mark.parametrize("spec", DRAFT_METHODS, ids=lambda s: s["method"])
def test_draft_tensor_parallel_other_than_the_targets_is_refused(spec):
    """vLLM's draft-model drafter would refuse it only inside the worker, after start."""
    with pytest.raises(SpecxConfigError) as exc:
        engine_config(fixture_model_dirs()[0],
                      {**pair_spec(spec), "draft_tensor_parallel_size": 1},
                      tensor_parallel_size=2)
    assert one_line(exc) == (
        f'speculative_config["draft_tensor_parallel_size"] = 1 is not allowed for method '
        f"'{spec['method']}' with tensor_parallel_size = 2: vLLM 0.32's draft-model drafter "
        "runs the draft at the target's tensor parallel size; use 2 or leave it unset."
    )


def test_specx_mtp_on_a_moe_target_under_data_parallel_is_refused():
    with pytest.raises(SpecxConfigError) as exc:
        engine_config(fixtures_root() / "mtp_target", MTP_SPEC, data_parallel_size=2)
    text = one_line(exc)
    assert text.startswith(
        "data_parallel_size = 2 is not allowed with speculative method 'specx_mtp' on a "
        "mixture-of-experts target (deepseek_v3): vLLM runs its data-parallel ranks in lockstep"
    )
    assert text.endswith("use data_parallel_size = 1 (tensor_parallel_size > 1 is supported), "
                         "or a dense target.")


def test_vllm_own_mtp_on_a_moe_target_under_data_parallel_is_left_to_vllm():
    """vLLM's fixed-K ``mtp`` drafts as many passes on every rank: not ours to refuse."""
    cfg = engine_config(fixtures_root() / "mtp_target",
                        {"method": "mtp", "num_speculative_tokens": 2}, data_parallel_size=2)
    assert cfg.model_config.is_moe and cfg.parallel_config.data_parallel_size == 2
    assert SPECX_CONFIG_KEY not in (cfg.additional_config or {})


@pytest.mark.parametrize("spec", [*DRAFT_METHODS, MTP_SPEC], ids=lambda s: s["method"])
def test_pipeline_parallel_is_refused_naming_vllms_limit(spec):
    target = (fixtures_root() / "mtp_target" if spec is MTP_SPEC
              else fixture_model_dirs()[0])
    given = spec if spec is MTP_SPEC else pair_spec(spec)
    with pytest.raises(SpecxConfigError) as exc:
        engine_config(target, given, pipeline_parallel_size=2)
    assert one_line(exc) == (
        f"pipeline_parallel_size = 2 is not allowed with speculative method '{spec['method']}': "
        "vLLM 0.32's V1 model runner (used by specx methods) builds the drafter on the last "
        "pipeline stage only and fails at start on the others; use pipeline_parallel_size = 1 "
        "(tensor_parallel_size > 1 and data parallel replicas of a dense model are supported)."
    )
