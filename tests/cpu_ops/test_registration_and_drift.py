"""When the reference ops register, and how drift makes registration fail loudly."""

from __future__ import annotations

import pytest
import torch

import vllm_specx.cpu_ops as cpu_ops
from vllm_specx.cpu_ops import decide, drift
from vllm_specx.cpu_ops.schemas import RELEASES, supported_releases

# --- the decision --------------------------------------------------------------------


@pytest.mark.parametrize(
    "device_type,compiled,want",
    [
        ("cpu", False, True),
        ("cpu", True, False),  # vLLM's own CPU build is installed
        ("cuda", False, False),
        ("npu", False, False),
        (None, False, False),  # platform could not be determined
        ("", False, False),
    ],
)
def test_decide(device_type, compiled, want):
    decision = decide(device_type, compiled)
    assert decision.register is want
    assert decision.reason


@pytest.fixture
def unregistered(monkeypatch):
    """Pretend this process has not registered yet (registration itself is stubbed in
    each test so the real ``_C`` namespace is never touched twice)."""
    monkeypatch.setattr(cpu_ops, "_library", None)
    monkeypatch.setattr(cpu_ops, "_registered_release", None)


def _fail(*args, **kwargs):
    raise AssertionError("must not be reached")


def test_not_registered_off_cpu_and_touches_no_kernels(unregistered, monkeypatch):
    monkeypatch.setattr(cpu_ops, "_current_device_type", lambda: "cuda")
    monkeypatch.setattr(cpu_ops, "_load_compiled_kernels", _fail)
    monkeypatch.setattr(cpu_ops, "_define_ops", _fail)
    assert cpu_ops.register_cpu_reference_ops_if_needed() is False
    assert cpu_ops.registered_release() is None


def test_not_registered_next_to_compiled_cpu_ops(unregistered, monkeypatch):
    loaded = []
    monkeypatch.setattr(cpu_ops, "_current_device_type", lambda: "cpu")
    monkeypatch.setattr(cpu_ops, "_load_compiled_kernels", lambda: loaded.append(True))
    monkeypatch.setattr(cpu_ops, "_compiled_cpu_attention_present", lambda: True)
    monkeypatch.setattr(cpu_ops, "_define_ops", _fail)
    assert cpu_ops.register_cpu_reference_ops_if_needed() is False
    assert loaded == [True]  # vLLM's compiled kernels were given the chance to load first


def test_unknown_vllm_release_raises_before_registering(unregistered, monkeypatch):
    monkeypatch.delenv(drift.ALLOW_DRIFT_ENV, raising=False)
    monkeypatch.setattr(cpu_ops, "_current_device_type", lambda: "cpu")
    monkeypatch.setattr(cpu_ops, "_load_compiled_kernels", lambda: None)
    monkeypatch.setattr(cpu_ops, "_compiled_cpu_attention_present", lambda: False)
    monkeypatch.setattr(drift, "installed_vllm_version", lambda: "0.99.1")
    monkeypatch.setattr(cpu_ops, "_define_ops", _fail)
    with pytest.raises(drift.CpuOpsDriftError, match=r"vLLM 0\.99\.1 is installed"):
        cpu_ops.register_cpu_reference_ops_if_needed()
    assert cpu_ops._library is None


# The release under test: these tests follow the installed vLLM (0.32.0 in the README's
# set-up, 0.33.0 under scripts/test_vllm033.sh).
INSTALLED = drift.release_key(drift.installed_vllm_version())


def test_unknown_release_with_drift_bypass_reports_the_table_it_borrowed(
    unregistered, monkeypatch
):
    monkeypatch.setenv(drift.ALLOW_DRIFT_ENV, "1")
    monkeypatch.setattr(cpu_ops, "_current_device_type", lambda: "cpu")
    monkeypatch.setattr(cpu_ops, "_load_compiled_kernels", lambda: None)
    monkeypatch.setattr(cpu_ops, "_compiled_cpu_attention_present", lambda: False)
    monkeypatch.setattr(drift, "installed_vllm_version", lambda: "0.99.1")
    monkeypatch.setattr(drift, "verify_vllm_call_sites", lambda release, version: None)
    monkeypatch.setattr(drift, "install_namespace_guard", lambda version, ops: None)
    from vllm_specx.cpu_ops import kernel_overrides, vllm_fixes

    monkeypatch.setattr(kernel_overrides, "install", lambda names: list(names))
    monkeypatch.setattr(vllm_fixes, "apply", lambda names: None)
    defined = []
    monkeypatch.setattr(cpu_ops, "_define_ops", lambda ops: defined.append(ops) or object())
    assert cpu_ops.register_cpu_reference_ops_if_needed() is True
    newest = supported_releases()[-1]
    assert cpu_ops.registered_release() == newest != "0.99.1"
    assert defined == [RELEASES[newest].ops]


def test_real_registration_is_idempotent(reference_ops):
    schemas_before = {
        name: str(getattr(torch.ops._C, name).default._schema)
        for name in RELEASES[INSTALLED].ops
    }
    assert cpu_ops.register_cpu_reference_ops_if_needed() is True
    assert cpu_ops.register_cpu_reference_ops_if_needed() is True
    assert cpu_ops.registered_release() == INSTALLED
    for name, schema in schemas_before.items():
        assert str(getattr(torch.ops._C, name).default._schema) == schema


def test_table_schemas_parse_and_match_implementations():
    impls = cpu_ops.implementations()
    for release in RELEASES.values():
        assert set(release.ops) <= set(impls)
        for name, schema in release.ops.items():
            parsed = torch._C.parse_schema(f"_C::{schema}")
            assert parsed.name == f"_C::{name}"


# --- the release gate ------------------------------------------------------------------


def test_release_key_ignores_local_build_label():
    assert drift.release_key("0.32.0+cpu") == "0.32.0"
    assert drift.release_key("0.32.0.dev3+g1234") == "0.32.0.dev3"


def test_select_release(monkeypatch):
    monkeypatch.delenv(drift.ALLOW_DRIFT_ENV, raising=False)
    assert drift.select_release("0.32.0+cpu") is RELEASES["0.32.0"]
    assert drift.select_release("0.33.0") is RELEASES["0.33.0"]
    assert drift.select_release(f"{INSTALLED}+cpu") is RELEASES[INSTALLED]
    with pytest.raises(drift.CpuOpsDriftError) as info:
        drift.select_release("0.34.0")
    assert "0.34.0" in str(info.value) and drift.ALLOW_DRIFT_ENV in str(info.value)
    monkeypatch.setenv(drift.ALLOW_DRIFT_ENV, "1")
    assert drift.select_release_key("0.34.0") == supported_releases()[-1]
    assert drift.select_release("0.34.0") is RELEASES[supported_releases()[-1]]


# --- the call-site scan ------------------------------------------------------------------

CPU_FILE = "v1/worker/cpu_worker.py"


def _problems(source: str, file: str = CPU_FILE) -> list[str]:
    return drift.check_call_sites(RELEASES["0.32.0"], "0.32.0", drift.scan_source(source, file))


def test_scan_accepts_current_call_shapes():
    assert _problems("torch.ops._C.init_cpu_memory_env([node])") == []
    assert _problems("torch.ops._C.rotary_embedding(p, q, k, 64, c, True)") == []
    assert _problems("torch.ops._C.rotary_embedding(p, q, k, 64, c, True, 0, True)") == []


def test_scan_names_an_unknown_op_on_the_cpu_path():
    [problem] = _problems("x = torch.ops._C.fused_rms_norm_quant(a, b)")
    assert "torch.ops._C.fused_rms_norm_quant" in problem
    assert "vLLM 0.32.0" in problem and f"vllm/{CPU_FILE}:1" in problem


def test_scan_ignores_unknown_ops_outside_the_cpu_path_and_known_fallbacks():
    assert _problems("torch.ops._C.gptq_marlin_gemm(a)", file="_custom_ops.py") == []
    probe = "torch.ops._C.copy_and_expand_dflash_inputs_kernel_impl(*a)"
    assert _problems(probe, file="utils/cpu_triton_utils.py") == []


@pytest.mark.parametrize(
    "call,why",
    [
        ("torch.ops._C.greedy_argmax(logits, extra)", "positional"),
        ("torch.ops._C.greedy_argmax()", "required"),
        ("torch.ops._C.fused_gumbel_argmax(logits, seed=s)", "keyword 'seed'"),
        ("torch.ops._C.expand_kernel_impl(o, i, c, 0, 0, 128)", "positional"),
    ],
)
def test_scan_names_a_call_our_schema_cannot_take(call, why):
    [problem] = _problems(call, file="_custom_ops.py")
    assert why in problem and "vLLM 0.32.0" in problem


def test_installed_vllm_matches_the_table():
    """The installed vLLM's CPU paths ask for exactly what the table provides."""
    import pathlib

    import vllm

    version = drift.installed_vllm_version()
    release = drift.select_release(version, allow_drift=False)
    sites = drift.scan_vllm(pathlib.Path(vllm.__file__).parent)
    assert drift.check_call_sites(release, version, sites) == []
    # Every op in the table is called somewhere we scan (no dead entries).
    assert set(release.ops) <= {s.op for s in sites}


# --- the runtime guard --------------------------------------------------------------------


def test_unknown_op_lookup_names_op_and_version(reference_ops):
    assert not hasattr(torch.ops._C, "definitely_not_an_op")  # hasattr probes still work
    with pytest.raises(drift.MissingCpuReferenceOpError) as info:
        torch.ops._C.definitely_not_an_op(torch.zeros(1))
    message = str(info.value)
    assert "torch.ops._C.definitely_not_an_op" in message
    assert f"vLLM {drift.installed_vllm_version()}" in message
    assert isinstance(info.value, AttributeError)
    assert torch.ops._C.greedy_argmax(torch.tensor([[0.0, 1.0]])).tolist() == [1]
