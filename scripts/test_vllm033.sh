#!/usr/bin/env bash
# The test suite against vLLM 0.33.0, in a venv of its own (the README's .venv stays on
# vLLM 0.32.0). CI runs it as the `vllm033` entry of .github/workflows/tests.yml.
#
# vLLM 0.33.0 cannot be installed normally on this project's hosts: it pins
# certifi>=2026.10.19, newer than the package index has, and torch==2.14.0, whose CPU
# build is not there either. So it is installed the way a user in that situation would:
#   1. torch 2.13.0, the CPU build (pip finds it locally; the CPU wheel index on CI);
#   2. vllm==0.33.0 with --no-deps;
#   3. vLLM's other requirements, read from its installed metadata, minus the torch
#      family pins (torch, torchvision, torchaudio, torchcodec: CUDA builds that break
#      `import vllm` next to a CPU torch) and with certifi unpinned;
#   4. vllm-specx (editable) with its test and bench extras.
# A second run finds its stamp and installs nothing.
#
# Usage: bash scripts/test_vllm033.sh [pytest args]     e.g. -m "not engine"
# Env:   VLLM033_VENV   where the venv lives (default: .venv-vllm033 at the repo root)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM033_VENV:-$ROOT/.venv-vllm033}"
PY="${PYTHON:-python3}"
VLLM_PIN="vllm==0.33.0"
TORCH_PIN="torch==2.13.0"

STAMP="$VENV/.specx-vllm033-$(cat "$ROOT/setup.py" "$ROOT/scripts/test_vllm033.sh" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  echo "[vllm033] setting up $VENV (one-time)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${PIP[@]}" "$TORCH_PIN" packaging
  "${PIP[@]}" --no-deps "$VLLM_PIN"
  REQS="$VENV/vllm033-requirements.txt"
  "$VENV/bin/python" - "$REQS" <<'EOF'
import sys
from importlib import metadata

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for text in metadata.requires("vllm") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an optional extra, or another platform
    if req.name in SKIP:
        continue
    if req.name == "certifi":
        lines.append("certifi")  # the pinned release is newer than the index has
        continue
    req.marker = None
    lines.append(str(req))
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
  "${PIP[@]}" -r "$REQS" "$TORCH_PIN"
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "${PIP[@]}" -e "$ROOT[test,bench]" "$TORCH_PIN"
  "$VENV/bin/python" -c "import vllm, vllm_specx; print('[vllm033] vllm', vllm.__version__, 'vllm-specx', vllm_specx.__version__)" >&2
  rm -f "$VENV"/.specx-vllm033-*
  touch "$STAMP"
fi

if ! command -v nvidia-smi >/dev/null 2>&1; then
  export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
"$VENV/bin/python" -c "import vllm; assert vllm.__version__.startswith('0.33.0'), vllm.__version__"
echo "[vllm033] ruff check" >&2
"$VENV/bin/ruff" check .
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "[vllm033] no tests were collected" >&2; exit 1; fi
exit "$rc"
