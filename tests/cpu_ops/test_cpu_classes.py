"""Every x86-64 CPU class is a first-class host (vllm_specx/cpu_host.py).

The suite runs on whatever machine a change is submitted from: an AVX2-only CPU, an
AVX-512 one, AVX512-BF16 or AMX. Three guards keep a test from assuming the CPU it was
written on:

* the class is read in ONE place (``vllm_specx.cpu_host``), honouring torch's and oneDNN's
  dispatch caps, so ``cpu_host.AVX2_SIMULATION_ENV`` makes any newer x86 host compute,
  and report itself, as an AVX2-only one;
* no test module probes the CPU by itself (a probe outside cpu_host is how a test comes to
  assert a feature instead of the product's choice for it);
* the CPU-sensitive tests are run again in a subprocess as an AVX2-only host, so the
  no-native-bfloat16 path (float32 default, bfloat16 left unpacked) runs on every machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specx import cpu_host

REPO = Path(__file__).resolve().parents[2]
AVX2_ENV = dict(cpu_host.AVX2_SIMULATION_ENV)
# torch's and oneDNN's feature probes, and the kernel's flag list: only cpu_host reads them.
PROBES = re.compile(r"_is_avx512_bf16_supported|_is_amx_tile_supported|"
                    r"_is_mkldnn_bf16_supported|get_cpu_capability|/proc/cpuinfo")


def _simulated(code: str, env: dict[str, str]) -> dict:
    full_env = {**os.environ, **env}
    full_env.pop("VLLM_SPECX_CPU_DTYPE", None)  # the suite's float32 pin; the default is asked
    out = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


CLASS_REPORT = """
import json, os, torch
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
from vllm_specx import cpu_host, engine
from vllm_specx.cpu_ops import linear
print(json.dumps({"class": cpu_host.cpu_class(), "native_bf16": cpu_host.native_bf16(),
                  "default_dtype": engine.default_dtype(),
                  "packs_bf16": linear.onednn_packs(torch.bfloat16),
                  "packs_f32": linear.onednn_packs(torch.float32),
                  "describe": cpu_host.describe("float32")}))
"""


def test_an_avx2_host_gets_float32_and_unpacked_bfloat16():
    if cpu_host.cpu_class() == cpu_host.OTHER:
        pytest.skip("not an x86-64 CPU with AVX2")
    got = _simulated(CLASS_REPORT, AVX2_ENV)
    assert got["class"] == cpu_host.AVX2
    assert got["native_bf16"] is False and got["default_dtype"] == "float32"
    assert got["packs_bf16"] is False and got["packs_f32"] is True
    assert got["describe"].startswith("AVX2 CPU") and got["describe"].endswith("float32")


def test_this_host_reports_a_class_and_the_matching_default():
    got = _simulated(CLASS_REPORT, {})
    assert got["class"] in cpu_host.CPU_CLASSES
    native = got["class"] in (cpu_host.AMX, cpu_host.AVX512_BF16)
    assert got["native_bf16"] is native
    assert got["default_dtype"] == ("bfloat16" if native else "float32")


def test_amx_hosts_cap_onednn_unless_told_not_to(monkeypatch):
    cap = cpu_host.cap_onednn_isa_for_exact_rows.__wrapped__  # uncached
    monkeypatch.delenv(cpu_host.ONEDNN_ISA_ENV, raising=False)
    monkeypatch.delenv(cpu_host.KEEP_AMX_ENV, raising=False)
    monkeypatch.setattr(cpu_host, "_torch_cpu_check", lambda name: True)  # an AMX CPU
    assert cap() is True
    assert os.environ[cpu_host.ONEDNN_ISA_ENV] == cpu_host.ONEDNN_NO_AMX_ISA
    assert cap() is False  # the user's (or an earlier) cap is kept
    monkeypatch.delenv(cpu_host.ONEDNN_ISA_ENV)
    monkeypatch.setenv(cpu_host.KEEP_AMX_ENV, "1")
    assert cap() is False and cpu_host.ONEDNN_ISA_ENV not in os.environ
    monkeypatch.delenv(cpu_host.KEEP_AMX_ENV)
    monkeypatch.setattr(cpu_host, "_torch_cpu_check", lambda name: False)  # no AMX
    assert cap() is False and cpu_host.ONEDNN_ISA_ENV not in os.environ


def test_no_test_module_probes_the_cpu_itself():
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PROBES.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, (
        "tests must ask vllm_specx.cpu_host (the product's choice for this CPU), not probe "
        "the CPU themselves:\n" + "\n".join(offenders))


def test_the_cpu_sensitive_tests_pass_as_an_avx2_host():
    # The tests that depend on the CPU class, run as an AVX2-only host: what CI on such a
    # machine would see. On an AVX2 host this repeats the normal run (cheap).
    if cpu_host.cpu_class() == cpu_host.OTHER:
        pytest.skip("not an x86-64 CPU with AVX2")
    env = {**os.environ, **AVX2_ENV}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs",
         "tests/cpu_ops/test_linear.py",
         "tests/cpu_ops/test_cpu_classes.py::test_this_host_reports_a_class_and_the_matching_default",
         # AVX2 kernels compute a row by its place in a product: attention must not care
         "tests/cpu_ops/test_tree_attention.py::test_rows_are_batch_invariant"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert "oneDNN cannot pack torch.bfloat16 on this AVX2 CPU" in run.stdout, tail
