"""pytest plugin for running vLLM's own tests with vllm-specx on or off.

Loaded by ``scripts/upstream_vllm/run.py`` (``-p specx_probe``) in both passes, so the
two differ only in ``VLLM_PLUGINS``:

* at start-up it loads vLLM's general plugins the way every vLLM process does
  (``vllm.plugins.load_general_plugins``; many of vLLM's unit tests build a runner or a
  scheduler directly and would otherwise never load a plugin), then checks that
  vllm-specx is registered exactly when the pass expects it (``SPECX_UPSTREAM_EXPECT``);
* it appends one JSON line per test to ``SPECX_UPSTREAM_RESULTS``: the outcome, the
  failure text, and for a failure the frames of vllm-specx's code in the traceback with
  the names of the vllm-specx patches those frames belong to.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

import pytest

_RESULTS = os.environ.get("SPECX_UPSTREAM_RESULTS", "")
_EXPECT = os.environ.get("SPECX_UPSTREAM_EXPECT", "")
_MAX_TEXT = 12000
_records: dict[str, dict[str, Any]] = {}
_patch_code: dict[types.CodeType, str] | None = None


def _write(record: dict[str, Any]) -> None:
    if _RESULTS:
        with open(_RESULTS, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def _specx_registered() -> bool:
    plugin = sys.modules.get("vllm_specx.plugin")
    return bool(plugin is not None and getattr(plugin, "_registered", False))


def pytest_configure(config: pytest.Config) -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    registered = _specx_registered()
    _write({"session": True, "specx_registered": registered,
            "vllm_plugins": os.environ.get("VLLM_PLUGINS")})
    if _EXPECT and (_EXPECT == "on") != registered:
        raise pytest.UsageError(
            f"vllm-specx is {'' if registered else 'not '}registered in the '{_EXPECT}' pass "
            f"(VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r})"
        )


def _code_to_patch() -> dict[types.CodeType, str]:
    """Code objects of the replacements vllm-specx installed in this process -> patch."""
    global _patch_code
    if _patch_code is not None:
        return _patch_code
    _patch_code = {}
    if not _specx_registered():
        return _patch_code
    try:
        from vllm_specx.glue.touchpoints import _vllm_patch_registries
    except ImportError:
        return _patch_code
    for _, objects in _vllm_patch_registries():
        for patch in objects:
            module = sys.modules.get(patch.module_name)
            if module is None:
                continue
            try:
                owner, attr = patch._owner_and_attr(module)
            except AttributeError:
                continue
            raw = owner.__dict__.get(attr)
            func = getattr(raw, "__func__", raw)
            code = getattr(func, "__code__", None)
            if code is not None and getattr(func, "__specx_patch__", None) == patch.name:
                _patch_code[code] = patch.name
    return _patch_code


def _specx_frames(excinfo: pytest.ExceptionInfo[BaseException]) -> tuple[list[str], list[str]]:
    """vllm-specx frames (``path:line in function``) of the exception and its chain, and
    the patches they belong to."""
    frames: list[str] = []
    patches: list[str] = []
    seen: set[int] = set()
    exc: BaseException | None = excinfo.value
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            path = code.co_filename.replace(os.sep, "/")
            if "/vllm_specx/" in path:
                short = "vllm_specx/" + path.rsplit("/vllm_specx/", 1)[1]
                frames.append(f"{short}:{tb.tb_lineno} in {code.co_name}")
                name = _code_to_patch().get(code)
                if name and name not in patches:
                    patches.append(name)
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return frames, patches


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        frames, patches = _specx_frames(call.excinfo)
        rec = _records.setdefault(item.nodeid, {})
        rec.setdefault("frames", []).extend(frames)
        for name in patches:
            if name not in rec.setdefault("patches", []):
                rec["patches"].append(name)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    rec = _records.setdefault(report.nodeid, {})
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup":
        if report.failed:
            rec["outcome"] = "error"
        elif report.skipped:
            rec["outcome"] = "xfailed" if xfail else "skipped"
    elif report.when == "call":
        if report.passed:
            rec["outcome"] = "xpassed" if xfail else "passed"
        elif report.skipped:
            rec["outcome"] = "xfailed" if xfail else "skipped"
        else:
            rec["outcome"] = "failed"
    elif report.when == "teardown" and report.failed and rec.get("outcome") == "passed":
        rec["outcome"] = "error"
    if report.failed:
        rec["text"] = (rec.get("text", "") + report.longreprtext)[-_MAX_TEXT:]
    if report.when == "teardown":
        _write({"nodeid": report.nodeid, "outcome": rec.get("outcome", "error"),
                "text": rec.get("text", ""), "frames": rec.get("frames", []),
                "patches": rec.get("patches", [])})
        _records.pop(report.nodeid, None)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"nodeid": report.nodeid, "outcome": "collection error", "collection": True,
                "text": report.longreprtext[-_MAX_TEXT:], "frames": [], "patches": []})
