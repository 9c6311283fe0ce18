"""Packaging for vllm-specx.

Why vLLM is an *extra* and not a hard requirement: on Ascend, vLLM is installed
from source with ``VLLM_TARGET_DEVICE=empty`` and vLLM-Ascend on top. A hard
``vllm`` requirement would make pip "fix" that install by pulling the CUDA wheel
from PyPI over it. So ``pip install vllm-specx`` never touches vLLM, and
``pip install vllm-specx[vllm]`` installs the pinned release for CUDA/CPU hosts.
The same specifier is the supported range that the plugin checks at load time
(``vllm_specx/version_gate.py`` reads it back from this package's metadata).
"""

from setuptools import find_packages, setup

SUPPORTED_VLLM = ">=0.32.0,<0.34"
# transformers needs both to convert the real target of `vllm-specx bench` (SmolLM2-135M-
# Instruct, shipped as a GGUF; vllm_specx/real_pair.py). In every extra a bench or the
# tests can come through: `[vllm]` for users, `[test,bench]` for scripts/setup_env.sh.
REAL_PAIR = ["gguf>=0.10", "accelerate>=0.26"]

setup(
    name="vllm-specx",
    version="0.1.0",
    description="New speculative-decoding methods (MTAD, adaptive length, MTP) for vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_specx", "vllm_specx.*"]),
    # Package data: the real pair's prompt sets and the committed drafter for SmolLM2-135M
    # (vllm_specx/models/smollm2_draft/), so `vllm-specx bench` works from a plain wheel.
    package_data={"vllm_specx": ["py.typed", "prompts/*.jsonl", "models/*/*"]},
    install_requires=["packaging"],
    extras_require={
        "vllm": [f"vllm{SUPPORTED_VLLM}", *REAL_PAIR],
        # mkdocs*: the documentation site (mkdocs.yml, docs/), built with --strict by the
        # test command so a broken link or a missing page fails the tests.
        "test": ["pytest>=8", "pytest-xdist>=3", "ruff>=0.6", "scipy", "transformers", "tokenizers",
                 "safetensors", "mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26",
                 *REAL_PAIR],
        "bench": ["matplotlib", "tqdm", *REAL_PAIR],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_specx = vllm_specx.plugin:register"],
        "console_scripts": ["vllm-specx = vllm_specx.cli:main"],
    },
)
