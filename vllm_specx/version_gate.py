"""The supported vLLM range, declared once in the package metadata and checked at load.

The range is the ``vllm`` requirement of the ``[vllm]`` extra (see setup.py), read back
from the installed metadata, so the number a user sees in ``pip show`` is the one the
plugin enforces. Set ``VLLM_SPECX_SKIP_VERSION_CHECK=1`` to run on another vLLM
(e.g. nightly) at your own risk.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_specx.envflags import env_flag

SKIP_ENV = "VLLM_SPECX_SKIP_VERSION_CHECK"
# Used only when the package metadata is unavailable (e.g. running from a source tree).
FALLBACK_RANGE = ">=0.32.0,<0.34"


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside the range vllm-specx supports."""


def supported_vllm_range() -> SpecifierSet:
    try:
        requires = metadata.requires("vllm-specx") or []
    except metadata.PackageNotFoundError:
        requires = []
    for line in requires:
        req = Requirement(line)
        if req.name == "vllm":
            return req.specifier
    return SpecifierSet(FALLBACK_RANGE)


def check_vllm_version(installed: str | None = None) -> None:
    """Raise :class:`UnsupportedVllmVersion` unless vLLM is in the supported range."""
    if env_flag(SKIP_ENV):
        return
    if installed is None:
        import vllm

        installed = vllm.__version__
    supported = supported_vllm_range()
    try:
        ok = supported.contains(Version(installed), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedVllmVersion(
            f"vllm-specx supports vLLM {supported}, but vLLM {installed} is installed. "
            f"Install a supported vLLM (pip install 'vllm-specx[vllm]'), or set "
            f"{SKIP_ENV}=1 to load the plugin anyway."
        )
