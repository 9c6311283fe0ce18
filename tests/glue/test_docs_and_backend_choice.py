"""The docs' defaults table is the code's, and the backend is chosen in one place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_specx.backends import BACKEND_MODULES, backend_for_device, select_backend
from vllm_specx.methods import defaults_table_markdown

ROOT = Path(__file__).parents[2]


def test_docs_defaults_table_matches_the_code():
    # The knobs page of the docs site (moved from the README, issue 35) carries the table
    # between its generated-table markers; scripts/update_docs_tables.py rewrites it.
    page = (ROOT / "docs" / "methods" / "knobs.md").read_text(encoding="utf-8")
    fix = "docs/methods/knobs.md is out of date: python scripts/update_docs_tables.py"
    assert defaults_table_markdown() in page, fix
    start = page.index("<!-- generated from vllm_specx/methods.py")
    end = page.index("<!-- end of generated table -->")
    assert page[start:end].split("\n", 1)[1].strip() == defaults_table_markdown().strip(), fix


def test_cpu_platform_selects_cpu_backend():
    backend = select_backend()  # tests run with VLLM_TARGET_DEVICE=cpu
    assert backend.name == "cpu" and backend.kernel_impl == "torch"


@pytest.mark.parametrize("device,impl,max_k", [("cuda", "triton", None), ("npu", "torch", 15),
                                               ("cpu", "torch", None)])
def test_each_device_declares_its_limits_and_kernels(device, impl, max_k):
    backend = backend_for_device(device)
    assert backend.name == device
    assert backend.kernel_impl == impl
    assert backend.limits.max_num_speculative_tokens == max_k
    assert backend.limits.max_beam_positions >= 16


def test_unknown_device_is_refused_with_the_supported_list():
    with pytest.raises(ValueError, match="no backend for device type 'xpu'.*cpu, cuda, npu"):
        backend_for_device("xpu")


def test_package_imports_without_torch_npu_or_triton_being_imported():
    code = (
        "import sys\n"
        "import vllm_specx, vllm_specx.backends as b, vllm_specx.config, vllm_specx.methods\n"
        "for d in b.BACKEND_MODULES: b.backend_for_device(d)\n"
        "print('torch_npu' in sys.modules, 'triton' in sys.modules, 'vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]
    assert set(BACKEND_MODULES) == {"cuda", "npu", "cpu"}


def test_methods_command_lists_methods_and_knobs():
    exe = Path(sys.executable).with_name("vllm-specx")
    out = subprocess.run([str(exe), "methods", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    listed = json.loads(out.stdout)
    assert listed["mtad"]["available"] is True and listed["mtad"]["lossless"] is False
    assert listed["mtad"]["knobs"]["num_beams"]["allowed"] == "an integer >= 1"
    assert listed["adaptive"]["available"] is True and listed["adaptive"]["lossless"] is True
    assert listed["specx_mtp"]["available"] is True and listed["specx_mtp"]["lossless"] is True
    # Which model runner (docs/model-runners.md): specx_mtp runs on V2 (with the adaptive stop
    # and draft_tree too: no setting keeps it on V1); specx_eagle on V1 only, with the reason.
    runner = listed["specx_mtp"]["model_runner"]
    assert runner["v2"] is True
    assert runner["v1_only"] == []
    assert runner["v2_cudagraph"] == "captured"
    eagle = listed["specx_eagle"]["model_runner"]
    assert eagle["v2"] is False and "no EAGLE" in eagle["v1_only"]
    text = subprocess.run([str(exe), "methods"], capture_output=True, text=True, timeout=120)
    assert defaults_table_markdown() in text.stdout


def test_top_level_help_names_every_shipped_method():
    from vllm_specx.cli import build_parser
    from vllm_specx.methods import METHODS

    text = build_parser().format_help()
    shipped = [name for name, spec in METHODS.items() if spec.available]
    assert {"mtad", "adaptive", "specx_mtp", "specx_eagle3"} <= set(shipped)
    assert all(name in text for name in shipped)
