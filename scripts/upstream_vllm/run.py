"""Run a subset of vLLM's own tests with vllm-specx loaded and left out; compare.

A vLLM plugin must not change vLLM's behaviour where its own methods are not used. This
script fetches the source distribution of the INSTALLED vLLM release (its tests are not
in the wheel), runs the chosen test files twice in the project's venv:

* ``on``:  as a user has it (every general plugin, vllm-specx included);
* ``off``: ``VLLM_PLUGINS`` naming only vLLM's built-in general plugins (checked: vllm-specx
  is then not registered),

and fails on every test that passes off and fails on, printing the test and the
vllm-specx frames and patch names in its traceback. The passes run with
``HF_HUB_OFFLINE=1`` and a hub cache holding config-only stand-ins
(``hub_configs/``: ``facebook/opt-125m``'s published config.json, which most scheduler
and runner tests read and nothing more); tests that need more of a hub model (weights,
a tokenizer, another model) fail in both passes and are counted as not covered; other
tests failing in both passes are counted as failing without the plugin too.

The sdist is cached under the project's cache directory (``$VLLM_SPECX_CACHE``, else
``$XDG_CACHE_HOME/vllm-specx`` or ``~/.cache/vllm-specx``), in ``upstream-vllm/``, so a
rerun is offline. Downloading it needs ``setuptools-rust`` and ``setuptools-scm`` (pip
prepares vLLM's metadata by running its setup.py, in this venv for its torch, as a CPU
build); they are installed into ``upstream-vllm/build-tools`` there, not into the venv.
vLLM's ``tests/conftest.py`` imports ``tblib``: that one package is installed into the
venv when missing.

Usage: bash scripts/upstream_vllm_tests.sh [--subset full|fast]
       [--keep DIR] [--compare DIR] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# The subsets of vLLM's tests (paths inside its sdist).
RUNNER_AND_SCHEDULER = [
    "tests/v1/worker/test_gpu_model_runner.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
]
SUBSETS: dict[str, list[str]] = {
    # The V1 model runner and scheduler: where vllm-specx patches vLLM.
    "fast": RUNNER_AND_SCHEDULER,
    "full": [
        "tests/v1/sample/test_rejection_sampler.py",
        "tests/v1/worker/test_gpu_rejection_sampler_chunking.py",
        "tests/v1/worker/test_gpu_rejection_sampler_i64.py",
        "tests/v1/spec_decode",
        *RUNNER_AND_SCHEDULER,
        "tests/config/test_speculative_draft_hf_overrides.py",
        "tests/config/test_speculative_draft_max_position_embeddings.py",
    ],
}

# Packages vLLM's test harness imports that the project's venv does not have
# (module -> PyPI name). Installed into the venv when missing.
TEST_PACKAGES = {"tblib": "tblib"}
BUILD_TOOLS = ("setuptools-rust", "setuptools-scm")

FAILED = ("failed", "error", "collection error", "not run")
PASSED = ("passed", "xpassed")
# A test that needs a hub model fails in both passes with one of these (HF_HUB_OFFLINE=1).
HUB_PATTERNS = re.compile(
    "|".join([
        r"OfflineModeIsEnabled", r"LocalEntryNotFoundError", r"HF_HUB_OFFLINE",
        r"huggingface\.co", r"RepositoryNotFoundError", r"GatedRepoError",
        r"outgoing traffic has been disabled", r"We couldn't connect to",
        r"is not a local folder and is not a valid model identifier",
        r"Can't load (?:the )?(?:tokenizer|config|model)",
        r"Temporary failure in name resolution", r"Max retries exceeded",
        r"Cannot find the requested files in the (?:disk )?cache",
        r"Invalid repository ID or local directory specified",
        r"Cannot find any model weights with",
    ])
)


def log(msg: str) -> None:
    print(f"[upstream-vllm] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """The project's cache directory (as vllm_specx.real_pair.cache_root) / upstream-vllm."""
    env = os.environ.get("VLLM_SPECX_CACHE")
    if env:
        base = Path(env).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vllm-specx"
    return base / "upstream-vllm"


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"[upstream-vllm] `{' '.join(cmd)}` failed:\n{tail}")


def ensure_sdist(version: str, cache: Path) -> Path:
    """vLLM's source distribution for ``version`` (downloaded once, then cached)."""
    tarball = cache / f"vllm-{version}.tar.gz"
    if tarball.is_file():
        return tarball
    tools = cache / "build-tools"
    if not all((tools / t.replace("-", "_")).is_dir() for t in BUILD_TOOLS):
        log(f"installing {', '.join(BUILD_TOOLS)} into {tools} (pip needs them to read "
            "vLLM's source distribution)")
        pip("install", "--target", str(tools), "--upgrade", *BUILD_TOOLS)
    log(f"downloading vLLM {version}'s source distribution (once) into {cache}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tools), env.get("PYTHONPATH")]))
    env["VLLM_TARGET_DEVICE"] = "cpu"  # metadata of a CPU build: no CUDA toolchain
    env["VLLM_VERSION_OVERRIDE"] = version
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        # --no-build-isolation: vLLM's setup.py imports torch, which this venv has.
        pip("download", "--no-deps", "--no-binary", "vllm", "--no-build-isolation",
            "-d", tmp, f"vllm=={version}", env=env)
        found = list(Path(tmp).glob("vllm-*.tar.gz"))
        if len(found) != 1:
            raise SystemExit(f"[upstream-vllm] pip left {found} instead of one vLLM sdist")
        found[0].replace(tarball)
    return tarball


def ensure_tests(tarball: Path, version: str, cache: Path) -> Path:
    """The sdist's tests/ (and pyproject.toml, for pytest's markers), unpacked once."""
    root = cache / f"vllm-{version}"
    stamp = root / ".unpacked"
    if stamp.is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    prefix = f"vllm-{version}/"
    with tarfile.open(tarball) as tar:
        members = [
            m for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"
        ]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(root, members=members, filter="data")
    stamp.touch()
    return root


def ensure_test_packages() -> None:
    missing = [pkg for mod, pkg in TEST_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        log(f"installing {', '.join(missing)} into the project venv (vLLM's tests/conftest.py "
            "imports it)")
        pip("install", *missing)


def stand_in_hub(cache: Path) -> Path:
    """An offline Hugging Face hub cache holding the config-only stand-ins.

    Most of vLLM's scheduler and runner tests build a ``ModelConfig`` for
    ``facebook/opt-125m`` and never load its weights or tokenizer: with that model's
    published config.json in the cache they run offline. A test that needs more of a hub
    model still fails in both passes and is counted as not covered.
    """
    hub = cache / "hub"
    revision = "0" * 40  # any commit id: the cache maps refs/main to it
    for config in sorted((HERE / "hub_configs").glob("*.json")):
        repo = hub / f"models--{config.stem}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        shutil.copyfile(config, snapshot / "config.json")
    return hub


def builtin_plugins() -> list[str]:
    """vLLM's own general plugins (the entry points its distribution declares)."""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return sorted(ep.name for ep in eps if ep.dist is not None and ep.dist.name == "vllm")


def run_pass(mode: str, root: Path, paths: list[str], extra: list[str], out_dir: Path,
             hub: Path) -> tuple[dict[str, dict], dict, float]:
    results = out_dir / f"{mode}.jsonl"
    results.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update({
        "SPECX_UPSTREAM_RESULTS": str(results),
        "SPECX_UPSTREAM_EXPECT": mode,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(hub),
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": env.get("VLLM_TARGET_DEVICE", "cpu"),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    if mode == "off":
        env["VLLM_PLUGINS"] = ",".join(builtin_plugins())
    else:
        env.pop("VLLM_PLUGINS", None)  # every installed plugin, as a user has it
    cmd = [sys.executable, "-m", "pytest", "-p", "specx_probe", "-p", "no:cacheprovider",
           "-q", "--tb=short", "--continue-on-collection-errors", "-o", "addopts=",
           "--rootdir", str(root), *paths, *extra]
    log(f"{mode}: {' '.join(cmd[3:])}" + (f"  (VLLM_PLUGINS={env['VLLM_PLUGINS']})"
                                          if mode == "off" else ""))
    start = time.monotonic()
    with open(out_dir / f"{mode}.log", "w", encoding="utf-8") as out:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    tests, session = load_results(results)
    if not session:
        tail = "\n".join((out_dir / f"{mode}.log").read_text().splitlines()[-20:])
        raise SystemExit(f"[upstream-vllm] the '{mode}' pass did not start (pytest exit "
                         f"{proc.returncode}):\n{tail}")
    log(f"{mode}: {len(tests)} results in {wall:.0f} s (pytest exit {proc.returncode}); "
        f"vllm-specx registered: {session['specx_registered']}")
    return tests, session, wall


def load_results(path: Path) -> tuple[dict[str, dict], dict]:
    """One pass's per-test records (the probe's JSON lines) and its session record."""
    session: dict = {}
    tests: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if rec.get("session"):
                session = rec
            else:
                tests[rec["nodeid"]] = rec
    return tests, session


def outcome_in(tests: dict[str, dict], nodeid: str) -> str:
    if nodeid in tests:
        return tests[nodeid]["outcome"]
    module = nodeid.split("::", 1)[0]
    if module in tests and tests[module].get("collection"):
        return "collection error"
    return "not run"


def compare(on: dict[str, dict], off: dict[str, dict]) -> int:
    ids = sorted(set(on) | set(off))
    regressions, fixed, hub, both_fail, other = [], [], [], [], []
    for nodeid in ids:
        a, b = outcome_in(off, nodeid), outcome_in(on, nodeid)
        text = on.get(nodeid, {}).get("text", "") + off.get(nodeid, {}).get("text", "")
        if a in PASSED and b in FAILED:
            regressions.append(nodeid)
        elif a in FAILED and b in PASSED:
            fixed.append(nodeid)
        elif a in FAILED and b in FAILED:
            (hub if HUB_PATTERNS.search(text) else both_fail).append(nodeid)
        elif a != b:
            other.append(f"{nodeid}: {a} without vllm-specx, {b} with it")

    def tally(tests: dict[str, dict]) -> str:
        counts = Counter(outcome_in(tests, n) for n in ids)
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))

    print(f"vLLM tests compared: {len(ids)} (collection errors count as one each)")
    print(f"  off (vLLM alone):        {tally(off)}")
    print(f"  on  (vllm-specx loaded): {tally(on)}")
    print(f"not covered (need a Hugging Face hub model, failed in both passes): {len(hub)}")
    print(f"fails without the plugin too (other reasons, e.g. CUDA-only kernels): "
          f"{len(both_fail)}")
    print(f"passes only with the plugin (its CPU reference ops): {len(fixed)}")
    print(f"other outcome changes (e.g. skipped one way): {len(other)}")
    for line in other:
        print(f"  {line}")
    print(f"pass off, fail on (regressions): {len(regressions)}")
    for nodeid in regressions:
        rec = on.get(nodeid, {})
        print(f"REGRESSION {nodeid}: {outcome_in(on, nodeid)} with vllm-specx, "
              f"{outcome_in(off, nodeid)} without")
        print(f"  patches in the traceback: {', '.join(rec.get('patches', [])) or 'none'}")
        for frame in rec.get("frames", []):
            print(f"  vllm-specx frame: {frame}")
        lines = [ln for ln in rec.get("text", "").splitlines() if ln.startswith("E ")]
        for ln in lines[-3:]:
            print(f"  {ln}")
    return 1 if regressions else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", choices=sorted(SUBSETS), default="full")
    parser.add_argument("--keep", type=Path, default=None,
                        help="directory for the passes' logs and results (default: temporary)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    parser.add_argument("--compare", type=Path, default=None, metavar="DIR",
                        help="only compare the results an earlier run left in DIR (--keep)")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(load_results(args.compare / "on.jsonl")[0],
                       load_results(args.compare / "off.jsonl")[0])

    import vllm

    version = vllm.__version__
    if not re.fullmatch(r"\d+\.\d+\.\d+(?:\.post\d+)?", version):
        print(f"[upstream-vllm] vLLM {version} is not a release on PyPI: its tests cannot be "
              "fetched as a source distribution", file=sys.stderr)
        return 2
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    root = ensure_tests(ensure_sdist(version, cache), version, cache)
    ensure_test_packages()
    log(f"vLLM {version}, tests from {root}, subset '{args.subset}'")

    keep = args.keep or Path(tempfile.mkdtemp(prefix="specx-upstream-"))
    keep.mkdir(parents=True, exist_ok=True)
    paths = SUBSETS[args.subset]
    start = time.monotonic()
    hub = stand_in_hub(cache)
    on, _, wall_on = run_pass("on", root, paths, args.pytest_args, keep, hub)
    off, _, wall_off = run_pass("off", root, paths, args.pytest_args, keep, hub)
    rc = compare(on, off)
    print(f"wall time: on {wall_on:.0f} s, off {wall_off:.0f} s, total "
          f"{time.monotonic() - start:.0f} s; logs and results in {keep}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
