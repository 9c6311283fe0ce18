"""The plugin as vLLM sees it: entry point, patches, config seam, CLI, version gate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from specx_log import specx_log_lines

from vllm_specx.config import SPECX_CONFIG_KEY
from vllm_specx.glue.patches import ALL_PATCHES, SpeculativeConfigTranslation
from vllm_specx.methods import METHODS
from vllm_specx.version_gate import (
    SKIP_ENV,
    UnsupportedVllmVersion,
    check_vllm_version,
    supported_vllm_range,
)

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A config-only Llama directory: enough for vLLM to build an engine config."""
    d = tmp_path_factory.mktemp("cfg-llama")
    (d / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    return str(d)


def engine_config(model_dir: str, speculative_config: dict | None, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model_dir, skip_tokenizer_init=True, speculative_config=speculative_config,
        **kw,
    ).create_engine_config()


def test_entry_point_is_discoverable_after_install():
    eps = metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "vllm_specx"]
    assert len(ours) == 1 and ours[0].value == "vllm_specx.plugin:register"
    assert ours[0].load().__module__ == "vllm_specx.plugin"


def test_vllm_loads_the_plugin_without_any_user_import():
    """A fresh interpreter that only uses vLLM ends up with every eager patch applied."""
    code = (
        "import sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "EngineArgs(model='x')\n"  # __post_init__ loads general plugins
        "assert 'vllm_specx.plugin' in sys.modules\n"
        "f = EngineArgs.create_speculative_config\n"
        "print(getattr(f, '__specx_patch__', None))\n"
        "print('vllm.v1.worker.gpu_model_runner' in sys.modules)\n"
        "import vllm.v1.worker.gpu_model_runner as r\n"
        "print(getattr(r.GPUModelRunner.__init__, '__specx_patch__', None))\n"
        "import torch; print(torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split()
    # eager patch applied; runner patch deferred until vLLM imports the runner, then applied
    assert lines[-4:] == ["speculative_config_translation", "False",
                          "runner_specx_components", "False"]


def test_register_is_idempotent():
    from vllm_specx import plugin

    plugin.register()
    plugin.register()
    for patch in ALL_PATCHES:
        patch.apply()  # a second apply must not wrap the wrapper
    from vllm.engine.arg_utils import EngineArgs

    wrapped = EngineArgs.create_speculative_config
    assert wrapped.__specx_patch__ == "speculative_config_translation"
    assert not hasattr(wrapped.__specx_original__, "__specx_patch__")


def _spec_fingerprint(cfg) -> tuple:
    spec = cfg.speculative_config
    fields = {f.name: repr(getattr(spec, f.name)) for f in dataclasses.fields(spec)
              if f.name not in ("target_model_config", "draft_model_config",
                                "target_parallel_config", "draft_parallel_config")}
    return (json.dumps(fields, sort_keys=True), repr(cfg.additional_config),
            cfg.compute_hash(), cfg.use_v2_model_runner)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        {"method": "draft_model", "num_speculative_tokens": 2},
        {"num_speculative_tokens": 2},  # no method: vLLM infers draft_model
    ],
)
def test_vllm_methods_give_identical_configs_with_and_without_the_plugin(model_dir, spec):
    spec = {**spec, "model": model_dir} if spec.get("method") != "ngram" else spec
    with_plugin = _spec_fingerprint(engine_config(model_dir, dict(spec)))
    patch = SpeculativeConfigTranslation()
    patch.revert()
    try:
        from vllm.engine.arg_utils import EngineArgs

        assert not hasattr(EngineArgs.create_speculative_config, "__specx_patch__")
        without_plugin = _spec_fingerprint(engine_config(model_dir, dict(spec)))
    finally:
        patch.apply()
    assert with_plugin == without_plugin


def test_vllm_methods_need_no_specx_backend(model_dir, monkeypatch):
    """vLLM's own methods also run on platforms vllm-specx has no backend for (XPU, TPU):
    the config seam hands them to vLLM before choosing a backend."""
    from vllm_specx import backends

    monkeypatch.setattr(backends, "BACKEND_MODULES", {})  # no backend for any device
    cfg = engine_config(model_dir, {"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 3})
    assert cfg.speculative_config.method == "ngram"
    with pytest.raises(ValueError, match="has no backend for device type"):
        engine_config(model_dir, {"method": "mtad", "model": model_dir,
                                  "num_speculative_tokens": 3})


def test_specx_method_builds_vllm_config_and_carries_settings(model_dir, monkeypatch):
    # Exercise the seam for every specx method, whether or not its drafter has shipped.
    for name, spec in METHODS.items():
        monkeypatch.setitem(METHODS, name, dataclasses.replace(spec, available=True))
    cfg = engine_config(model_dir, {"method": "mtad", "model": model_dir,
                                    "num_speculative_tokens": 3, "num_beams": 2,
                                    "acceptance_threshold": 0.25})
    assert cfg.speculative_config.method == "draft_model"
    assert cfg.speculative_config.num_speculative_tokens == 3
    assert cfg.speculative_config.draft_model_config.model == model_dir
    assert cfg.additional_config[SPECX_CONFIG_KEY] == {
        "method": "mtad", "num_speculative_tokens": 3, "num_beams": 2,
        "acceptance_threshold": 0.25, "greedy_drafting": "chain", "draft_tree": False,
        "cost_control": True,
    }
    assert cfg.use_v2_model_runner is False


def test_spec_flags_select_specx_methods(model_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    for name, spec in METHODS.items():
        monkeypatch.setitem(METHODS, name, dataclasses.replace(spec, available=True))
    cfg = EngineArgs(model=model_dir, skip_tokenizer_init=True, spec_method="mtad",
                     spec_model=model_dir, spec_tokens=2).create_engine_config()
    assert cfg.speculative_config.method == "draft_model"
    # No num_beams given: the knob's default is filled in.
    assert cfg.additional_config[SPECX_CONFIG_KEY]["num_beams"] == 4


def test_unavailable_method_fails_at_engine_config(model_dir, monkeypatch):
    # Every method has shipped: mark one unavailable, as a method still in the works is.
    name = "adaptive"
    monkeypatch.setitem(METHODS, name, dataclasses.replace(METHODS[name], available=False))
    config = {"method": name, **({"model": model_dir} if METHODS[name].needs_draft_model else {})}
    with pytest.raises(ValueError, match="not available yet in this version"):
        engine_config(model_dir, config)


def test_ragged_draft_methods_run_with_synchronous_scheduling(model_dir):
    """adaptive hands the scheduler a different number of drafts per request, which
    vLLM's async scheduling (K placeholder slots per request) cannot carry: the
    translation turns it off, and an explicit request for it is refused in one line."""
    assert METHODS["adaptive"].ragged_drafts
    spec = {"method": "adaptive", "model": model_dir, "num_speculative_tokens": 3}
    cfg = engine_config(model_dir, dict(spec))
    assert cfg.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match=r"async_scheduling = true is not allowed") as err:
        engine_config(model_dir, dict(spec), async_scheduling=True)
    assert "\n" not in str(err.value)


def test_mtad_depth_control_runs_synchronously_on_either_runner(model_dir, monkeypatch):
    """mtad with "cost_control": true (its default) or "greedy" drafts one depth 0..K
    per step (ragged lists to the scheduler): async scheduling off, refused in one line
    naming cost_control and its value when asked for, saying when it is the default and how
    to keep async scheduling; it is no V1-only setting (issue 32): forcing Model Runner V2
    meets no specx refusal, only vLLM's own where Triton is missing. Without the control
    mtad keeps vLLM's scheduling choice."""
    spec = {"method": "mtad", "model": model_dir, "num_speculative_tokens": 3,
            "num_beams": 2, "cost_control": "greedy"}
    assert METHODS["mtad"].v1_only_reason(spec) is None
    cfg = engine_config(model_dir, dict(spec))
    assert cfg.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match=r"'mtad' with cost_control \"greedy\": it drafts"
                                         r'.*"cost_control": false') as err:
        engine_config(model_dir, dict(spec), async_scheduling=True)
    assert "\n" not in str(err.value)
    default = {k: v for k, v in spec.items() if k != "cost_control"}
    assert engine_config(model_dir, dict(default)).scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match=r"cost_control true \(its default\): it drafts.*"
                                         r'"cost_control": false') as err:
        engine_config(model_dir, dict(default), async_scheduling=True)
    assert "\n" not in str(err.value)
    engine_config(model_dir, {**spec, "cost_control": False}, async_scheduling=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="Model Runner V2 requires Triton"):
        engine_config(model_dir, dict(spec))


def test_v2_runner_request_is_refused_for_what_runs_on_v1_only(model_dir, monkeypatch):
    """Forcing V2 is refused, naming the reason, for a method that runs on V1 only
    (specx_eagle) and for a setting that keeps a V2 method on V1: docs/model-runners.md
    ("How the runner is chosen")."""
    for name, spec in METHODS.items():
        monkeypatch.setitem(METHODS, name, dataclasses.replace(spec, available=True))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert not METHODS["specx_eagle"].runs_on_v2
    with pytest.raises(ValueError, match="V1 model runner only .*no EAGLE") as err:
        engine_config(model_dir, {"method": "specx_eagle", "model": model_dir})
    assert "\n" not in str(err.value)
    # A setting that keeps a V2 method on V1 (MethodSpec.v1_only_settings; none ships
    # today: the EAGLE / MTP adaptive stop runs on V2 too) is refused the same way.
    from vllm_specx.methods import ADAPTIVE_STOP_NEEDS_V1

    eagle3 = dataclasses.replace(METHODS["specx_eagle3"],
                                 v1_only_settings=(ADAPTIVE_STOP_NEEDS_V1,))
    monkeypatch.setitem(METHODS, "specx_eagle3", eagle3)
    assert eagle3.v1_only_reason({"adaptive": False}) is None
    with pytest.raises(ValueError, match="V1 model runner only .adaptive = true"):
        engine_config(model_dir, {"method": "specx_eagle3", "model": model_dir,
                                  "adaptive": True})


def test_tree_configs_need_synchronous_scheduling(model_dir, monkeypatch):
    """draft_tree (issue 37): vLLM schedules the tree's node budget, synchronously; async
    scheduling is refused in one line naming draft_tree. mtad and adaptive trees run on
    Model Runner V2 too (issue 34, glue/v2_tree_step.py): forcing it meets no specx
    refusal."""
    spec = {"method": "mtad", "model": model_dir, "num_speculative_tokens": 3,
            "num_beams": 2, "draft_tree": True}
    cfg = engine_config(model_dir, dict(spec))
    assert cfg.speculative_config.num_speculative_tokens == 6
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.use_v2_model_runner is False
    with pytest.raises(ValueError, match="'mtad' with draft_tree: it drafts") as err:
        engine_config(model_dir, dict(spec), async_scheduling=True)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    for method_spec in (spec, {"method": "adaptive", "model": model_dir, "draft_tree": True}):
        # No specx refusal: what remains is vLLM's own (no Triton in this process; the V2
        # engine tests run V2 under the Triton interpreter: tests/v2/test_v2_trees.py).
        with pytest.raises(ValueError, match="Model Runner V2 requires Triton") as err:
            engine_config(model_dir, dict(method_spec))
        assert "draft_tree" not in str(err.value)


# -- a real CLI process --------------------------------------------------------------
def _vllm_serve(model_dir: str, *args: str) -> subprocess.CompletedProcess:
    vllm_bin = Path(sys.executable).with_name("vllm")
    return subprocess.run(
        [str(vllm_bin), "serve", model_dir, "--skip-tokenizer-init", "--port", "0", *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )


@pytest.mark.engine
def test_vllm_serve_refuses_bad_knob_before_engine_start(model_dir):
    out = _vllm_serve(model_dir, "--speculative-config",
                      json.dumps({"method": "mtad", "model": model_dir, "num_beams": 0}))
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert 'speculative_config["num_beams"] = 0 is not allowed for method \'mtad\'' in text
    assert "Starting vLLM" not in text or "EngineCore" not in text  # refused before start


@pytest.mark.engine
def test_vllm_serve_accepts_spec_method_flag(model_dir):
    out = _vllm_serve(model_dir, "--spec-method", "mtad", "--spec-model", model_dir,
                      "--spec-tokens", "0")
    text = out.stdout + out.stderr
    assert "invalid choice" not in text  # argparse took the specx method
    assert 'speculative_config["num_speculative_tokens"] = 0' in text


# -- version gate --------------------------------------------------------------------
def test_supported_range_comes_from_package_metadata():
    import re

    from packaging.specifiers import SpecifierSet

    setup_py = (Path(__file__).parents[2] / "setup.py").read_text()
    declared = re.search(r'SUPPORTED_VLLM = "([^"]+)"', setup_py).group(1)
    assert supported_vllm_range() == SpecifierSet(declared)
    import vllm

    check_vllm_version(vllm.__version__)  # the installed pin passes


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.0+empty", "0.32.3", "0.32.1.dev7+gabc", "0.33.0", "0.33.0+cpu"]
)
def test_supported_versions_pass(version, monkeypatch):
    monkeypatch.delenv(SKIP_ENV, raising=False)
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.34.0.dev1", "1.0.0", "garbage"])
def test_unsupported_versions_fail_clearly(version, monkeypatch):
    monkeypatch.delenv(SKIP_ENV, raising=False)
    with pytest.raises(UnsupportedVllmVersion) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert version in message and str(supported_vllm_range()) in message and SKIP_ENV in message


def test_version_gate_bypass(monkeypatch):
    monkeypatch.setenv(SKIP_ENV, "1")
    check_vllm_version("0.99.0")


# `vllm serve` with a specx method serving completions on loopback: tests/load starts one
# such server per method (with no user import) and checks the translation, the greedy
# outputs and vLLM's spec-decode counters; a second mtad server here cost ~40 s.


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_the_runner_line_names_the_runner_vllm_chooses(model_dir, monkeypatch, env):
    """Issue 36 item 3: the front end used to log "... on Model Runner V2" even when
    VLLM_USE_V2_MODEL_RUNNER=0 (or a CPU without Triton) made vLLM build V1. The line
    now names the runner VllmConfig.use_v2_model_runner chooses."""

    from vllm.triton_utils import HAS_TRITON

    if env == "1" and not HAS_TRITON:
        pytest.skip("vLLM itself refuses Model Runner V2 without Triton")
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    with specx_log_lines() as lines:
        cfg = engine_config(model_dir, {"method": "adaptive", "model": model_dir,
                                        "num_speculative_tokens": 2})
    announced = [line for line in lines if "on Model Runner" in line]
    assert len(announced) == 1, lines
    runner = "V2" if cfg.use_v2_model_runner else "V1"
    assert f"adaptive on Model Runner {runner}" in announced[0], (announced, runner)
    if env == "0":
        assert runner == "V1" and "VLLM_USE_V2_MODEL_RUNNER=0" in announced[0]


def test_ragged_configs_on_cuda_v2_with_cuda_graphs_are_warned_before_start():
    """On CUDA, Model Runner V2, with CUDA graphs, a ragged config's steps miss V2's FULL
    decode graph (measured 0.18-0.19x on an H200): one warning line before start; none
    on CPU, on V1, eager, or for a fixed K that vLLM's own speculator drafts."""
    from vllm_specx.glue.patches import ragged_graphs_warning

    adaptive = {"method": "adaptive", "num_speculative_tokens": 8}
    message = ragged_graphs_warning("adaptive", adaptive, "cuda", True, False)
    assert message is not None and "0.18-0.19x" in message and "\n" not in message
    for backend, on_v2, eager in (("cpu", True, False), ("cuda", False, False),
                                  ("cuda", True, True)):
        assert ragged_graphs_warning("adaptive", adaptive, backend, on_v2, eager) is None
    fixed = {"method": "specx_eagle3", "num_speculative_tokens": 3}
    assert ragged_graphs_warning("specx_eagle3", fixed, "cuda", True, False) is None
    assert ragged_graphs_warning("specx_eagle3", {**fixed, "adaptive": True}, "cuda", True,
                                 False) is not None
