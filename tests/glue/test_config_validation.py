"""Bad speculative configs are refused with ONE line naming key, value and what is allowed.

These run the pure validator with vLLM's real method list and SpeculativeConfig fields
and the real device limits of each backend; the engine-level seam is covered in
test_engine_args.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specx.backends import BACKEND_MODULES, backend_for_device
from vllm_specx.backends.base import SAMPLER_MAX_SPEC_LEN
from vllm_specx.config import SpecxConfigError, speculative_config_dict, translate
from vllm_specx.glue.patches import vllm_method_names, vllm_speculative_fields
from vllm_specx.methods import METHODS, CheckContext, Knob, MethodSpec, Refusal

VLLM_METHODS = vllm_method_names()
VLLM_FIELDS = vllm_speculative_fields()


def run(config: dict, device: str = "cpu", check_available: bool = False):
    backend = backend_for_device(device)
    return translate(
        config,
        vllm_methods=VLLM_METHODS,
        vllm_fields=VLLM_FIELDS,
        limits=backend.limits,
        device=device,
        check_available=check_available,
    )


def write_head(path: Path, hidden: int, *, out_rows: int = 2, weights: bool = True) -> Path:
    """A minimal safetensors acceptance head: blocks of [H, H] and an output [rows, H]."""
    path.mkdir(parents=True, exist_ok=True)
    if not weights:
        return path
    tensors = {"blocks.0.weight": [hidden, hidden], "out.weight": [out_rows, hidden]}
    header, offset, payload = {}, 0, b""
    for name, shape in tensors.items():
        n = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        payload += b"\0" * n
        offset += n
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + payload)
    return path


@pytest.fixture()
def draft_dir(tmp_path: Path) -> str:
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return str(d)


def refused(config: dict, *fragments: str, device: str = "cpu") -> str:
    with pytest.raises(SpecxConfigError) as info:
        run(config, device=device)
    message = str(info.value)
    assert "\n" not in message, "one line"
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


M = {"method": "mtad", "model": "draft-dir"}
A = {"method": "adaptive", "model": "draft-dir"}

BAD_CASES = [
    # (id, config, fragments the message must contain, device)
    ("unknown-method", {"method": "beam"}, ['"method"] = "beam"', "mtad", "adaptive",
                                            "specx_mtp", "ngram", "draft_model", "eagle3"], "cpu"),
    ("method-not-string", {"method": 3}, ['"method"] = 3', "valid methods"], "cpu"),
    ("mtad-model-missing", {"method": "mtad"}, ['"model"] is missing', "'mtad'",
                                               "draft model"], "cpu"),
    ("mtad-model-empty", {**M, "model": "  "}, ['"model"] = "  "', "non-empty string"], "cpu"),
    ("mtad-model-not-string", {**M, "model": 5}, ['"model"] = 5', "non-empty string"], "cpu"),
    ("k-zero", {**M, "num_speculative_tokens": 0}, ['"num_speculative_tokens"] = 0',
                                                    "integer >= 1"], "cpu"),
    ("k-string", {**M, "num_speculative_tokens": "4"}, ['"num_speculative_tokens"] = "4"',
                                                        "integer >= 1"], "cpu"),
    ("k-bool", {**M, "num_speculative_tokens": True}, ['"num_speculative_tokens"] = true',
                                                       "integer"], "cpu"),
    ("k-float", {**M, "num_speculative_tokens": 2.5}, ["= 2.5", "integer >= 1"], "cpu"),
    ("k-null", {**M, "num_speculative_tokens": None}, ['"num_speculative_tokens"] = null',
                                                       "integer >= 1", "'mtad'"], "cpu"),
    ("k-above-sampler-limit", {**M, "num_speculative_tokens": 129, "num_beams": 1},
     ['"num_speculative_tokens"] = 129', "at most 128", "rejection sampler"], "cpu"),
    ("k-above-sampler-limit-cuda", {**M, "num_speculative_tokens": 129, "num_beams": 1},
     ['"num_speculative_tokens"] = 129', "at most 128", "rejection sampler"], "cuda"),
    ("beams-zero", {**M, "num_beams": 0}, ['"num_beams"] = 0', "integer >= 1", "'mtad'"], "cpu"),
    ("beams-null", {**M, "num_beams": None}, ['"num_beams"] = null', "integer >= 1"], "cpu"),
    ("beams-string", {**M, "num_beams": "4"}, ['"num_beams"] = "4"', "integer >= 1"], "cpu"),
    ("beams-bool", {**M, "num_beams": True}, ['"num_beams"] = true', "integer >= 1"], "cpu"),
    ("tau-zero", {**M, "acceptance_threshold": 0}, ['"acceptance_threshold"] = 0',
                                                    "(0, 1]"], "cpu"),
    ("tau-above-one", {**M, "acceptance_threshold": 1.5}, ["= 1.5", "(0, 1]"], "cpu"),
    ("tau-string", {**M, "acceptance_threshold": "0.3"}, ['= "0.3"', "(0, 1]"], "cpu"),
    ("tau-nan", {**M, "acceptance_threshold": float("nan")}, ["= nan", "(0, 1]"], "cpu"),
    ("beam-positions-cpu", {**M, "num_beams": 32, "num_speculative_tokens": 16},
     ['"num_beams"] = 32', "= 512 exceeds 256", "cpu"], "cpu"),
    ("ascend-k-limit", {**M, "num_speculative_tokens": 16, "num_beams": 1},
     ['"num_speculative_tokens"] = 16', "at most 15", "K + 1 <= 16"], "npu"),
    ("ascend-beam-positions", {**M, "num_speculative_tokens": 15, "num_beams": 8},
     ['"num_beams"] = 8', "= 120 exceeds 64"], "npu"),
    ("stop-threshold-one", {**A, "stop_threshold": 1.0}, ['"stop_threshold"] = 1.0',
                                                          "(0, 1)", "'adaptive'"], "cpu"),
    ("stop-threshold-zero", {**A, "stop_threshold": 0}, ['"stop_threshold"] = 0', "(0, 1)"],
     "cpu"),
    ("confidence-negative", {**A, "confidence_threshold": -0.1},
     ['"confidence_threshold"] = -0.1', "(0, 1)"], "cpu"),
    ("min-k-above-k", {**A, "num_speculative_tokens": 4, "min_speculative_tokens": 5},
     ['"min_speculative_tokens"] = 5', "at most num_speculative_tokens (4)"], "cpu"),
    ("min-k-zero", {**A, "min_speculative_tokens": 0}, ['"min_speculative_tokens"] = 0',
                                                        "integer >= 1"], "cpu"),
    ("head-missing-path", {**A, "acceptance_head": "/nonexistent/head"},
     ['"acceptance_head"] = "/nonexistent/head"', "does not exist"], "cpu"),
    ("mtad-takes-adaptive-knob", {**M, "stop_threshold": 0.5},
     ['"stop_threshold"] = 0.5', "belongs to specx method 'adaptive'", "'mtad'"], "cpu"),
    ("adaptive-takes-mtad-knob", {**A, "num_beams": 4},
     ['"num_beams"] = 4', "belongs to specx method 'mtad'"], "cpu"),
    ("vllm-method-with-specx-knob", {"method": "draft_model", "model": "d", "num_beams": 2},
     ['"num_beams"] = 2', "'mtad'", "not to vLLM's 'draft_model'"], "cpu"),
    ("specx-knob-without-method", {"model": "d", "acceptance_threshold": 0.2},
     ['"acceptance_threshold"] = 0.2', "'mtad'", 'set "method"'], "cpu"),
    ("ngram-key-on-mtad", {**M, "prompt_lookup_max": 4},
     ['"prompt_lookup_max"] = 4', "vLLM's ngram method"], "cpu"),
    ("rejection-method-on-mtad", {**M, "rejection_sample_method": "synthetic"},
     ['"rejection_sample_method"] = "synthetic"', "specx sampler"], "cpu"),
    ("heterogeneous-vocab-not-bool", {**M, "use_heterogeneous_vocab": "yes"},
     ['"use_heterogeneous_vocab"] = "yes"', "true or false"], "cpu"),
    ("heterogeneous-vocab-on-adaptive", {**A, "use_heterogeneous_vocab": True},
     ['"use_heterogeneous_vocab"] = true', "only 'mtad'"], "cpu"),
    ("unknown-key", {**M, "beams": 4}, ['"beams"] = 4', "unknown key", "num_beams"], "cpu"),
    ("unsupported-vllm-field", {**M, "num_speculative_tokens_per_batch_size": "1:4"},
     ['"num_speculative_tokens_per_batch_size"] = "1:4"', "not supported with specx methods",
      "allowed keys"], "cpu"),
    ("mtp-stop-without-adaptive", {"method": "specx_mtp", "stop_threshold": 0.5},
     ['"stop_threshold"] = 0.5', '"adaptive": true'], "cpu"),
    ("mtp-adaptive-not-bool", {"method": "mtp", "adaptive": "yes"},
     ['"adaptive"] = "yes"', "true or false", "'specx_mtp'"], "cpu"),
    ("ascend-mtp-k-limit", {"method": "specx_mtp", "num_speculative_tokens": 20},
     ["= 20", "at most 15", "K + 1 <= 16"], "npu"),
]


@pytest.mark.parametrize(
    "config,fragments,device", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_input_is_refused_with_one_clear_line(config, fragments, device):
    refused(config, *fragments, device=device)


def test_at_least_25_refusals_are_covered():
    assert len(BAD_CASES) >= 25


def test_acceptance_head_without_weights(tmp_path, draft_dir):
    head = write_head(tmp_path / "head", 64, weights=False)
    refused({**A, "model": draft_dir, "acceptance_head": str(head)},
            '"acceptance_head"]', "model.safetensors")


def test_acceptance_head_wrong_hidden_size(tmp_path, draft_dir):
    head = write_head(tmp_path / "head", 32)
    refused({**A, "model": draft_dir, "acceptance_head": str(head)},
            '"acceptance_head"]', "hidden size 64", "expects hidden size 32")


def test_acceptance_head_without_two_class_output(tmp_path, draft_dir):
    head = write_head(tmp_path / "head", 64, out_rows=3)
    refused({**A, "model": draft_dir, "acceptance_head": str(head)},
            '"acceptance_head"]', "[2, hidden]")


def test_acceptance_head_that_fits_is_accepted(tmp_path, draft_dir):
    head = write_head(tmp_path / "head", 64)
    result = run({**A, "model": draft_dir, "acceptance_head": str(head)})
    assert result.specx_settings["acceptance_head"] == str(head)


def test_hub_id_head_is_left_for_load_time(draft_dir):
    result = run({**A, "model": draft_dir, "acceptance_head": "org/specdec-head"})
    assert result.specx_settings["acceptance_head"] == "org/specdec-head"


# -- translation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        {"method": "ngram", "prompt_lookup_max": 4, "num_speculative_tokens": 3},
        {"method": "draft_model", "model": "d", "num_speculative_tokens": 3},
        {"method": "eagle3", "model": "d", "num_speculative_tokens": 2},
        {"method": "mtp", "num_speculative_tokens": 1},
        {"model": "d", "num_speculative_tokens": 2},
    ],
)
def test_vllm_methods_are_not_ours(config):
    assert run(config) is None


def test_mtad_translates_to_draft_model_with_defaults():
    result = run({"method": "mtad", "model": "d"})
    assert result.vllm_speculative_config == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 4,
    }
    assert result.specx_settings == {
        "method": "mtad", "num_speculative_tokens": 4, "num_beams": 4,
        "acceptance_threshold": 0.1, "greedy_drafting": "chain", "draft_tree": False,
        "cost_control": True,
    }


def test_hyphenated_keys_and_passthrough():
    result = run({"method": "mtad", "model": "d", "num-speculative-tokens": 2, "num_beams": 2,
                  "draft_tensor_parallel_size": 1, "max_model_len": 256})
    assert "use_heterogeneous_vocab" not in result.vllm_speculative_config
    assert result.vllm_speculative_config == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 2,
        "draft_tensor_parallel_size": 1, "max_model_len": 256,
    }
    assert result.specx_settings["num_beams"] == 2


def test_mtad_hands_heterogeneous_vocab_to_vllm():
    result = run({"method": "mtad", "model": "d", "use_heterogeneous_vocab": True})
    assert result.vllm_speculative_config["use_heterogeneous_vocab"] is True
    assert result.vllm_speculative_config["method"] == "draft_model"
    assert "use_heterogeneous_vocab" not in result.specx_settings


@pytest.mark.parametrize("method", ["draft_model", None])
def test_heterogeneous_vocab_stays_vllms_key_for_vllm_methods(method):
    config = {"model": "d", "use_heterogeneous_vocab": True}
    if method is not None:
        config["method"] = method
    assert run(config) is None


def test_adaptive_translation():
    result = run({"method": "adaptive", "model": "d", "num_speculative_tokens": 12,
                  "stop_threshold": 0.3, "min_speculative_tokens": 2})
    assert result.vllm_speculative_config["method"] == "draft_model"
    assert result.specx_settings == {
        "method": "adaptive", "num_speculative_tokens": 12, "min_speculative_tokens": 2,
        "stop_threshold": 0.3, "acceptance_head": None, "confidence_threshold": 0.5,
        "confidence_signal": "token_prob", "draft_sampling": "sampled", "cost_control": True,
        "draft_tree": False,
    }


@pytest.mark.parametrize(("config", "allowed"), [
    ({"method": "adaptive", "model": "d", "cost_control": "off"}, "true or false"),
    ({"method": "adaptive", "model": "d", "cost_control": 0}, "true or false"),
    ({"method": "specx_mtp", "cost_control": True}, '"adaptive": true'),
    ({"method": "specx_eagle3", "model": "d", "cost_control": True}, '"adaptive": true'),
    ({"method": "mtad", "model": "d", "cost_control": 1}, 'true, false or "greedy"'),
])
def test_cost_control_knob_refused_in_one_line(config, allowed):
    with pytest.raises(SpecxConfigError) as err:
        run(config)
    msg = str(err.value)
    assert "\n" not in msg and "cost_control" in msg and allowed in msg


def test_cost_control_off():
    result = run({"method": "adaptive", "model": "d", "cost_control": False})
    assert result.specx_settings["cost_control"] is False
    result = run({"method": "specx_eagle3", "model": "d", "adaptive": True,
                  "cost_control": False})
    assert result.specx_settings["cost_control"] is False


@pytest.mark.parametrize("config", [
    {"method": "specx_mtp", "cost_control": False},
    {"method": "specx_eagle3", "model": "d", "cost_control": False},
    {"method": "specx_eagle3", "model": "d", "adaptive": False, "cost_control": False},
])
def test_cost_control_off_where_it_does_not_apply_is_accepted(config):
    # Turning a switch off is never an error: without "adaptive": true every request
    # drafts K and there is no cost control to turn off (the value is carried as given).
    result = run(config)
    assert result.specx_settings.get("cost_control", False) is False
    assert result.specx_settings.get("adaptive", False) is False
    assert "cost_control" not in result.vllm_speculative_config


def test_mtad_cost_control_defaults_to_on_and_takes_three_values():
    # issue 32: mtad's per-step depth control, on by default for every step ("greedy":
    # all-greedy steps only; docs/cost-control.md); on, it runs on either model runner
    # (plans on V1 and V2).
    from vllm_specx.methods import METHODS, drafts_ragged

    default = run({"method": "mtad", "model": "d"})
    assert default.specx_settings["cost_control"] is True
    assert drafts_ragged(default.specx_settings) and drafts_ragged(default.specx_settings,
                                                                   on_v2=True)
    assert METHODS["mtad"].v1_only_reason(default.specx_settings) is None
    greedy = run({"method": "mtad", "model": "d", "cost_control": "greedy"})
    assert greedy.specx_settings["cost_control"] == "greedy"
    assert "cost_control" not in greedy.vllm_speculative_config
    assert drafts_ragged(greedy.specx_settings)
    assert METHODS["mtad"].v1_only_reason(greedy.specx_settings) is None
    off = run({"method": "mtad", "model": "d", "cost_control": False, "draft_tree": True})
    assert off.specx_settings["cost_control"] is False
    assert METHODS["mtad"].v1_only_reason(off.specx_settings) is None
    assert not drafts_ragged(run({"method": "mtad", "model": "d",
                                  "cost_control": False}).specx_settings)
    # With its beam tree too (the tree control prunes it, glue/tree_cost.py), either runner.
    for value in (True, "greedy"):
        tree = run({"method": "mtad", "model": "d", "cost_control": value, "draft_tree": True})
        assert tree.specx_settings["cost_control"] == value
        assert tree.specx_settings["draft_tree"] is True
        assert METHODS["mtad"].v1_only_reason(tree.specx_settings) is None
    # Anything else: one line naming the key, the value and what is allowed.
    for bad in ("sampled", 1, None):
        with pytest.raises(SpecxConfigError, match=r'cost_control.*true, false or "greedy"'):
            run({"method": "mtad", "model": "d", "cost_control": bad})


def test_another_method_s_switch_turned_on_is_still_refused():
    for config in ({"method": "adaptive", "model": "d", "adaptive": True},
                   {"method": "mtad", "model": "d", "stop_threshold": 0.5}):
        with pytest.raises(SpecxConfigError, match="belongs to specx method"):
            run(config)
    result = run({"method": "adaptive", "model": "d", "adaptive": False})
    assert "adaptive" not in result.specx_settings


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("confidence_signal", "entropy", '"token_prob", "max_prob" or "top2_margin"'),
    ("draft_sampling", "beam", '"sampled" or "greedy"'),
    ("draft_sampling", True, '"sampled" or "greedy"'),
])
def test_adaptive_string_knobs_refused_in_one_line(key, value, allowed):
    with pytest.raises(SpecxConfigError) as err:
        run({"method": "adaptive", "model": "d", key: value})
    msg = str(err.value)
    assert "\n" not in msg and key in msg and allowed in msg


def test_mtp_with_a_specx_knob_is_specx_mtp():
    result = run({"method": "mtp", "num_speculative_tokens": 2, "adaptive": True,
                  "stop_threshold": 0.4})
    assert result.vllm_speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert result.specx_settings["method"] == "specx_mtp"
    assert result.specx_settings["adaptive"] is True
    assert result.specx_settings["stop_threshold"] == 0.4


def test_specx_mtp_leaves_k_to_vllm():
    result = run({"method": "specx_mtp"})
    assert result.vllm_speculative_config == {"method": "mtp"}


def test_unavailable_method_fails_at_start_without_fallback():
    unavailable = [name for name, spec in METHODS.items() if not spec.available]
    for name in unavailable:
        config = {"method": name, "model": "d"} if METHODS[name].needs_draft_model else {
            "method": name}
        with pytest.raises(SpecxConfigError, match="not available yet in this version"):
            run(config, check_available=True)


def test_passthrough_keys_are_real_vllm_fields():
    """Drift check: a vLLM upgrade that drops a field we pass through must fail here."""
    from vllm_specx.methods import CONFLICTING_VLLM_KEYS, PASSTHROUGH_VLLM_KEYS

    assert PASSTHROUGH_VLLM_KEYS <= VLLM_FIELDS
    assert set(CONFLICTING_VLLM_KEYS) <= VLLM_FIELDS


# -- limits the runtime asserts are validation rules (issue 17) ----------------------
def test_sampler_limit_is_vllms_max_spec_len():
    """The sampler asserts max_spec_len <= MAX_SPEC_LEN: our constant must be vLLM's."""
    from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN

    assert SAMPLER_MAX_SPEC_LEN == MAX_SPEC_LEN
    for device in BACKEND_MODULES:
        limit, reason = backend_for_device(device).limits.speculative_tokens_limit()
        assert limit <= MAX_SPEC_LEN and reason


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("device", sorted(BACKEND_MODULES))
def test_every_method_refuses_k_the_runtime_cannot_run(method, device):
    limit, reason = backend_for_device(device).limits.speculative_tokens_limit()
    config = {"method": method, "num_speculative_tokens": limit + 1}
    if METHODS[method].needs_draft_model:
        config["model"] = "d"
    if METHODS[method].knob("num_beams") is not None:
        config["num_beams"] = 1  # keep num_beams * K under the beam limit
    refused(config, f'"num_speculative_tokens"] = {limit + 1}', f"at most {limit}", reason,
            device=device)


def test_largest_k_the_sampler_takes_is_accepted():
    result = run({**M, "num_speculative_tokens": SAMPLER_MAX_SPEC_LEN, "num_beams": 1})
    assert result.vllm_speculative_config["num_speculative_tokens"] == SAMPLER_MAX_SPEC_LEN


def test_specx_mtp_null_k_means_from_the_mtp_config():
    # specx_mtp's own default is "unset" (vLLM reads K from the MTP config), so an
    # explicit null is that default, not an error.
    result = run({"method": "specx_mtp", "num_speculative_tokens": None})
    assert result.vllm_speculative_config == {"method": "mtp"}


# -- a speculative_config that is not a dict (issue 17) --------------------------------
@pytest.mark.parametrize(
    "value,shown,kind",
    [("mtad", '= "mtad"', "not a string"), ([1, 2], "= [1, 2]", "not a list"),
     (5, "= 5", "not a number"), ({1: 2}, "key 1", "strings")],
)
def test_non_dict_speculative_config_is_one_line(value, shown, kind):
    with pytest.raises(SpecxConfigError) as info:
        speculative_config_dict(value)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("speculative_config ") and shown in message and kind in message
    assert '{"method": "mtad"' in message  # what is allowed, by example


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory) -> str:
    """Enough of a Llama directory for vLLM to build an engine config (no weights)."""
    d = tmp_path_factory.mktemp("cfg-only")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    }))
    return str(d)


@pytest.mark.parametrize(
    "value,shown",
    [("mtad", 'speculative_config = "mtad" is not allowed'),
     ([1, 2], "speculative_config = [1, 2] is not allowed"),
     ({"method": "mtad", "model": "d", "num_speculative_tokens": None},
      'speculative_config["num_speculative_tokens"] = null is not allowed'),
     # Passed validation before and then killed the engine at the sampler's assertion.
     ({"method": "mtad", "model": "d", "num_speculative_tokens": 129, "num_beams": 1},
      'speculative_config["num_speculative_tokens"] = 129 is not allowed')],
)
def test_engine_args_refuse_with_our_line(config_only_model, value, shown):
    """Through vLLM's own EngineArgs: our line, not vLLM's 3-line pydantic error or a raw
    ValueError/TypeError from inside the patch."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=config_only_model, skip_tokenizer_init=True,
                      speculative_config=value)
    with pytest.raises(SpecxConfigError) as info:
        args.create_engine_config()
    assert "\n" not in str(info.value) and shown in str(info.value)


@pytest.mark.engine
def test_vllm_serve_refuses_non_dict_speculative_config(config_only_model):
    """The CLI: argument parsing and config creation fail before any engine starts."""
    vllm_bin = Path(sys.executable).with_name("vllm")
    out = subprocess.run(
        [str(vllm_bin), "serve", config_only_model, "--skip-tokenizer-init", "--port", "0",
         "--speculative-config", "[1,2]"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "speculative_config = [1, 2] is not allowed: it must be a JSON object" in text
    assert "dictionary update sequence" not in text  # the raw error is gone
    assert "EngineCore" not in text  # refused before any engine process


# -- one method, one place (issue 11) --------------------------------------------------
def test_methods_module_imports_without_torch_or_vllm():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['vllm'] = None\n"  # any import fails
        "from vllm_specx import methods\n"
        "print(sorted(methods.METHODS), methods.METHODS['mtad'].rule)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mtad" in out.stdout


def test_each_method_declares_its_rule_and_shipped_ones_their_proposer():
    from vllm_specx.algorithms.verify import RULES

    for spec in METHODS.values():
        assert spec.rule in RULES, spec.name
        assert spec.rule == "standard" or not spec.lossless, spec.name
        if spec.available:
            assert isinstance(spec.proposer(), type), spec.name


def test_sampler_reads_the_rule_from_the_spec(monkeypatch):
    from vllm_specx.glue.sampler import verification_rule

    assert verification_rule({"method": "mtad"}) == "mtad"
    assert verification_rule({"method": "adaptive"}) == "standard"
    monkeypatch.setitem(METHODS, "adaptive",
                        dataclasses.replace(METHODS["adaptive"], rule="mtad"))
    assert verification_rule({"method": "adaptive"}) == "mtad"


def test_a_new_method_is_one_spec_entry(monkeypatch):
    """Validation has no knowledge of particular methods: a spec entry with its own knob
    and cross-knob check is validated through it, and nothing else."""
    seen: list[CheckContext] = []

    def width_within_k(ctx: CheckContext) -> Refusal | None:
        seen.append(ctx)
        width, k = ctx.settings["width"], ctx.settings["num_speculative_tokens"]
        return None if width <= k else Refusal("width", width, f"at most K ({k})")

    toy = MethodSpec(
        name="toy", vllm_method="draft_model", summary="a test method", lossless=True,
        needs_draft_model=True, default_num_speculative_tokens=3,
        knobs=(Knob("width", "int", 2, "an integer >= 1", "toy width", lambda v: v >= 1),),
        checks=(width_within_k,),
    )
    monkeypatch.setitem(METHODS, "toy", toy)
    result = run({"method": "toy", "model": "d"})
    assert result.specx_settings == {"method": "toy", "num_speculative_tokens": 3, "width": 2}
    assert seen[-1].spec is toy and seen[-1].model == "d" and seen[-1].device == "cpu"
    refused({"method": "toy", "model": "d", "width": 5},
            '"width"] = 5 is not allowed for method \'toy\'', "at most K (3)")
    refused({"method": "toy", "model": "d", "width": 0}, '"width"] = 0', "integer >= 1")


@pytest.mark.parametrize("config", [
    {"method": "specx_eagle3", "model": "d", "draft_tree": {"max_nodes": 8}},
    {"method": "adaptive", "model": "d", "draft_tree": True},
])
def test_tree_cost_control_is_on_unless_turned_off(config):
    """Draft trees are pruned by cost (glue/tree_cost.py) by default, as chains are
    planned (issue 32); cost_control false verifies every drafted tree whole. On an
    EAGLE head it applies with a draft_tree as with adaptive."""
    assert run(config).specx_settings["cost_control"] is True
    assert run({**config, "cost_control": False}).specx_settings["cost_control"] is False
