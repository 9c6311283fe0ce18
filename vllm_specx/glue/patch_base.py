"""The machinery of vllm-specx's patches of vLLM: :class:`VllmPatch` and a post-import hook.

Every change vllm-specx makes to a vLLM attribute is one :class:`VllmPatch` object that
says what it replaces, why, and the vLLM releases it was checked against
(``verified_on``). The patches themselves live where their reason lives
(:mod:`vllm_specx.glue.patches` for the plugin's seams, :mod:`vllm_specx.cpu_ops` for
the CPU reference backend); :mod:`vllm_specx.glue.touchpoints` lists all of them, with
every other vLLM touch-point, and holds the upgrade checklist.

Patches on modules that are expensive to import (the model runner) are applied when
vLLM itself imports the module (a post-import hook), so registering the plugin stays
cheap in processes that never build a runner, e.g. the API server.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.RLock()


# The vLLM releases every patch was re-read against and tested on (the default of
# ``VllmPatch.verified_on``). A release joins only after the upgrade checklist in
# vllm_specx/glue/touchpoints.py was done for it; the touch-point tests fail on a vLLM
# release that some patch was not verified on.
VERIFIED_RELEASES: tuple[str, ...] = ("0.32.0", "0.33.0")


class PatchTargetMissing(RuntimeError):
    """The attribute a patch replaces is not in this vLLM (an upgrade changed it)."""


class VllmPatch:
    """A named replacement of one attribute of a vLLM class or module.

    Subclasses set ``name``, ``target`` (``"module:Qualified.attr"``), ``replaces``,
    ``why``, ``scope`` and ``verified_on``, and implement :meth:`wrap`, which receives
    the original attribute and returns its replacement.
    """

    name: str = ""
    target: str = ""
    replaces: str = ""
    why: str = ""
    # Where the patch applies: "always" (every process that loads the plugin) or
    # "cpu-reference" (CPU platform without vLLM's compiled CPU ops); see touchpoints.py.
    scope: str = "always"
    # vLLM releases (public versions) whose ``target`` was re-read and tested.
    verified_on: tuple[str, ...] = VERIFIED_RELEASES
    lazy: bool = False  # apply when vLLM imports the module, not at registration
    # True when the replacement is a whole new function rather than a wrapper: it then
    # keeps its own name and signature (vLLM's kernel dispatcher forwards arguments by
    # the replacement's parameter names, which functools.wraps would hide).
    outright: bool = False

    def wrap(self, original: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- machinery -----------------------------------------------------------------
    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    def _owner_and_attr(self, module: Any) -> tuple[Any, str]:
        owner = module
        *path, attr = self.target.split(":", 1)[1].split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, attr

    def apply(self) -> None:
        if self.lazy and self.module_name not in sys.modules:
            _when_imported(self.module_name, self._apply_to)
        else:
            self._apply_to(importlib.import_module(self.module_name))

    def _apply_to(self, module: Any) -> None:
        with _lock:
            owner, attr = self._owner_and_attr(module)
            raw = owner.__dict__.get(attr)
            if raw is None:
                import vllm

                raise PatchTargetMissing(
                    f"vllm-specx patch {self.name} targets {self.target}, which vLLM "
                    f"{vllm.__version__} does not have (verified on vLLM "
                    f"{', '.join(self.verified_on)}; see vllm_specx/glue/touchpoints.py)."
                )
            if getattr(raw, "__specx_patch__", None) == self.name:
                return  # idempotent: vLLM loads plugins several times per process
            descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
            original = raw.__func__ if descriptor else raw
            replacement = self.wrap(original)
            if not self.outright:
                functools.update_wrapper(replacement, original)
            replacement.__specx_patch__ = self.name
            replacement.__specx_original__ = original
            setattr(owner, attr, descriptor(replacement) if descriptor else replacement)
            if descriptor:
                owner.__dict__[attr].__specx_patch__ = self.name
            self.after_apply(module)

    def after_apply(self, module: Any) -> None:
        """Hook for work that must follow the swap (e.g. re-registering a kernel)."""

    def revert(self) -> None:
        """Undo the patch (tests use this to compare behaviour with and without it)."""
        module = sys.modules.get(self.module_name)
        if module is None:
            return
        with _lock:
            owner, attr = self._owner_and_attr(module)
            raw = owner.__dict__.get(attr)
            descriptor = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
            func = raw.__func__ if descriptor else raw
            original = getattr(func, "__specx_original__", None)
            if original is not None:
                setattr(owner, attr, descriptor(original) if descriptor else original)


# -- post-import hooks ---------------------------------------------------------------
_pending: dict[str, list[Callable[[Any], None]]] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs registered callbacks right after a watched module finishes executing."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        # Find the real spec with every other finder, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _CallbackLoader(spec.loader, fullname)
                return spec
        return None


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, fullname: str) -> None:
        self._inner = inner
        self._fullname = fullname

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for callback in _pending.pop(self._fullname, []):
            callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_finder = _PostImportFinder()


def _when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    with _lock:
        module = sys.modules.get(module_name)
        if module is not None:
            callback(module)
            return
        _pending.setdefault(module_name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)

