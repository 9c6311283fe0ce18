"""Drift checks: never compute something wrong for a vLLM we were not written for.

Three layers, cheapest first (all run only when the reference ops are registered):

1. **Release gate.** The installed vLLM release (its public version, so local build
   labels such as ``+cpu`` are ignored) must be a key of the drift table
   (:mod:`vllm_specx.cpu_ops.schemas`); otherwise registration raises
   :class:`CpuOpsDriftError` naming the release.
2. **Call-site scan.** We parse (``ast``, ~30 ms) the vLLM source files that make up
   the CPU engine's path and collect every ``torch.ops._C.<name>(...)`` call. An op
   called there that the table neither implements nor lists as knowingly
   unimplemented raises, naming the op, file, line and release. For ops we implement,
   every call site anywhere in those files and in ``_custom_ops.py`` must fit our
   schema (positional count and keyword names), so a grown or reordered argument list
   is caught before the engine runs.
3. **Runtime guard.** ``torch.ops._C.<name>`` for a name nobody registered raises
   :class:`MissingCpuReferenceOpError`, which names the op and the vLLM release.
   It subclasses ``AttributeError`` so vLLM's ``hasattr(torch.ops._C, ...)`` feature
   probes keep answering False and take their fallbacks.

Bypass: ``VLLM_SPECX_CPU_OPS_ALLOW_DRIFT=1`` turns failures of (1) and (2) into
warnings and uses the newest table entry, for trying a new vLLM before the table is
updated. (3) always stays on: a missing op can only fail, so it may as well fail
clearly.
"""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from vllm_specx.cpu_ops.schemas import (
    CALL_SITE_SOURCES,
    CPU_PATH_SOURCES,
    RELEASES,
    ReleaseTable,
    supported_releases,
)
from vllm_specx.envflags import env_flag

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger and handlers

ALLOW_DRIFT_ENV = "VLLM_SPECX_CPU_OPS_ALLOW_DRIFT"
DOCS = "docs/cpu-reference-backend.md"


class CpuOpsDriftError(RuntimeError):
    """The installed vLLM asks for CPU ops or schemas the drift table does not know."""


class MissingCpuReferenceOpError(AttributeError):
    """``torch.ops._C.<op>`` was requested but neither vLLM nor vllm-specx provides it."""

    def __init__(self, op: str, vllm_version: str, implemented: list[str]) -> None:
        self.op = op
        self.vllm_version = vllm_version
        super().__init__(
            f"vLLM {vllm_version} asked for torch.ops._C.{op}, which the vllm-specx CPU "
            f"reference backend does not implement (it implements: "
            f"{', '.join(sorted(implemented))}). Use vLLM's own CPU build for this "
            f"model/feature, or add the op to vllm_specx/cpu_ops (see {DOCS})."
        )


def drift_allowed() -> bool:
    return env_flag(ALLOW_DRIFT_ENV)


def installed_vllm_version() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        from vllm.version import __version__

        return __version__


def release_key(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``; pre/dev/post releases stay distinct."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).public
    except InvalidVersion:
        return version


def select_release_key(version: str, *, allow_drift: bool | None = None) -> str:
    """The drift-table key whose ops serve ``version``, or raise :class:`CpuOpsDriftError`.

    Normally the release of ``version`` itself; with the drift bypass on, an unknown
    release gets the newest table (and a warning), and that table's key is returned, so
    callers can say which table is actually in use."""
    allow = drift_allowed() if allow_drift is None else allow_drift
    key = release_key(version)
    if key in RELEASES:
        return key
    known = supported_releases()
    message = (
        f"vllm-specx's CPU reference ops are written for vLLM {', '.join(known)}, but "
        f"vLLM {version} is installed; its CPU ops may have changed. Add vLLM {key} to "
        f"the drift table in vllm_specx/cpu_ops/schemas.py (see {DOCS})"
    )
    if not allow:
        raise CpuOpsDriftError(f"{message}, or set {ALLOW_DRIFT_ENV}=1 to try anyway.")
    logger.warning("%s; %s=1, so using the table of vLLM %s.", message, ALLOW_DRIFT_ENV, known[-1])
    return known[-1]


def select_release(version: str, *, allow_drift: bool | None = None) -> ReleaseTable:
    """The drift-table entry for ``version`` (see :func:`select_release_key`)."""
    return RELEASES[select_release_key(version, allow_drift=allow_drift)]


@dataclass(frozen=True)
class CallSite:
    op: str
    file: str  # relative to the vllm package
    line: int
    num_positional: int
    keywords: tuple[str, ...]
    has_star_args: bool


def _is_torch_ops_c(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "_C"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "ops"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "torch"
    )


def scan_source(source: str, file: str) -> list[CallSite]:
    """Every ``torch.ops._C.<op>(...)`` call in ``source``."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is_torch_ops_c(node.func.value)
        ):
            sites.append(
                CallSite(
                    op=node.func.attr,
                    file=file,
                    line=node.lineno,
                    num_positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                    keywords=tuple(k.arg for k in node.keywords if k.arg is not None),
                    has_star_args=any(isinstance(a, ast.Starred) for a in node.args)
                    or any(k.arg is None for k in node.keywords),
                )
            )
    return sites


def scan_vllm(vllm_root: Path, files: tuple[str, ...] = CALL_SITE_SOURCES) -> list[CallSite]:
    """Call sites in the given vLLM files; a listed file that vanished is drift too."""
    sites: list[CallSite] = []
    for rel in files:
        path = vllm_root / rel
        if not path.is_file():
            sites.append(CallSite("<missing file>", rel, 0, 0, (), False))
            continue
        sites.extend(scan_source(path.read_text(encoding="utf-8"), rel))
    return sites


def _schema_fits(schema: str, site: CallSite) -> str | None:
    """Why ``site`` cannot bind to ``schema``, or None when it fits."""
    args = torch._C.parse_schema(f"_C::{schema}").arguments
    names = [a.name for a in args]
    if site.has_star_args:
        return None  # cannot count statically; the runtime schema check still applies
    if site.num_positional > len(args):
        return f"passes {site.num_positional} positional arguments, schema takes {len(args)}"
    for kw in site.keywords:
        if kw not in names:
            return f"passes keyword {kw!r}, which the schema does not have"
        if names.index(kw) < site.num_positional:
            return f"passes {kw!r} both by position and by keyword"
    given = set(names[: site.num_positional]) | set(site.keywords)
    missing = [a.name for a in args if a.name not in given and not a.has_default_value()]
    if missing:
        return f"does not pass required argument(s) {missing}"
    return None


def check_call_sites(release: ReleaseTable, version: str, sites: list[CallSite]) -> list[str]:
    """Problems found in ``sites`` against ``release`` (empty list: no drift)."""
    problems = []
    for site in sites:
        where = f"vllm/{site.file}:{site.line}"
        if site.op == "<missing file>":
            problems.append(f"vLLM {version} has no vllm/{site.file} (CPU path moved)")
        elif site.op in release.ops:
            why = _schema_fits(release.ops[site.op], site)
            if why:
                problems.append(
                    f"vLLM {version} calls torch.ops._C.{site.op} at {where} in a way our "
                    f"schema does not accept: {why}"
                )
        elif site.file in CPU_PATH_SOURCES and site.op not in release.known_unimplemented:
            problems.append(
                f"vLLM {version} calls torch.ops._C.{site.op} at {where}, an op the "
                f"vllm-specx CPU reference backend does not implement"
            )
    return problems


def verify_vllm_call_sites(release: ReleaseTable, version: str) -> None:
    """Scan the installed vLLM and raise :class:`CpuOpsDriftError` on any problem."""
    import vllm

    root = Path(vllm.__file__).parent
    problems = check_call_sites(release, version, scan_vllm(root))
    if not problems:
        return
    text = "; ".join(problems)
    if drift_allowed():
        logger.warning("CPU reference op drift (%s=1, continuing): %s", ALLOW_DRIFT_ENV, text)
        return
    raise CpuOpsDriftError(f"{text}. Update the drift table (see {DOCS}).")


def install_namespace_guard(vllm_version: str, implemented: list[str]) -> None:
    """Make unknown ``torch.ops._C.<op>`` lookups raise :class:`MissingCpuReferenceOpError`.

    Done by switching the class of the existing ``torch.ops._C`` namespace object to
    a subclass (so every holder of the object sees the guard) whose ``__getattr__``
    re-raises torch's AttributeError with the clear message. Idempotent.
    """
    namespace = torch.ops._C
    base = type(namespace)
    if getattr(base, "_vllm_specx_guard", False):
        base._vllm_specx_version = vllm_version
        base._vllm_specx_implemented = list(implemented)
        return

    class GuardedOpNamespace(base):  # type: ignore[valid-type, misc]
        _vllm_specx_guard = True
        _vllm_specx_version = vllm_version
        _vllm_specx_implemented = list(implemented)

        def __getattr__(self, name: str):  # noqa: ANN204 - mirrors the base signature
            try:
                return super().__getattr__(name)
            except AttributeError as exc:
                if name.startswith("__"):
                    raise
                cls = type(self)
                raise MissingCpuReferenceOpError(
                    name, cls._vllm_specx_version, cls._vllm_specx_implemented
                ) from exc

    namespace.__class__ = GuardedOpNamespace
