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


def installed_version(distribution: str) -> str:
    """The installed version of a distribution, or "unknown" (e.g. a source tree)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


# The vLLM-Ascend source the Ascend hooks (vllm_specx/glue/ascend.py) were read against
# (github vllm-project/vllm-ascend, branch main; .github/vllm-release-tag.commit there
# names the vLLM release it tracks).
ASCEND_MIRROR = "vllm-ascend main@182b75ea84 (2026-08-22, tracking vLLM 0.27.1)"
ASCEND_MIRROR_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"

# vLLM-Ascend/vLLM pairs the Ascend hooks (vllm_specx/glue/ascend.py) were run on an NPU
# with. None yet: they were written against vllm-ascend main@182b75ea84 (2026-08-22),
# which tracks vLLM 0.27.1, and checked with fakes of that source only.
VERIFIED_ASCEND_PAIRS: tuple[tuple[str, str], ...] = ()


def vllm_ascend_pair_note(ascend_version: str | None = None,
                          vllm_version: str | None = None) -> str | None:
    """One line when the installed vLLM-Ascend/vLLM pair is not one the Ascend hooks
    were verified on (None when it is). Which vLLM-Ascend release pairs with which vLLM
    release is vLLM-Ascend's choice (same X.Y.Z); this only says what is installed."""
    if ascend_version is None:
        ascend_version = installed_version("vllm_ascend")
    if vllm_version is None:
        import vllm

        vllm_version = vllm.__version__
    if (ascend_version, vllm_version) in VERIFIED_ASCEND_PAIRS:
        return None
    mismatch = ""
    try:
        ascend_release = Version(ascend_version).release[:3]
        if ascend_release != Version(vllm_version).release[:3]:
            mismatch = (
                f" (vLLM-Ascend {ascend_version} is made for vLLM "
                f"{'.'.join(map(str, ascend_release))}, not {vllm_version})"
            )
    except InvalidVersion:
        pass
    return (
        f"vllm-specx: the Ascend hooks were written against {ASCEND_MIRROR} and checked "
        f"with fakes only; installed: vLLM-Ascend {ascend_version} with vLLM "
        f"{vllm_version}{mismatch}. Their targets were found; their behaviour on this pair "
        "is unverified: run the NPU checks in docs/ascend.md."
    )
