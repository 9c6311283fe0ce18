#!/usr/bin/env bash
# Idempotent set-up for this checkout: a .venv at the repo root with the pinned vLLM
# and vllm-specx (editable) installed. Sourced (via scripts/env.sh) by scripts/bench.sh and scripts/test.sh;
# a second run finds its stamp and installs nothing.
#
# CPU hosts (no nvidia-smi): the CPU build of torch, then vLLM without the CUDA-only
# packages its PyPI wheel asks for (scripts/vllm_cpu_requirements.py says which and why).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
# Overridable so CI can also test against vLLM nightly (see .github/workflows/tests.yml).
VLLM_PIN="${VLLM_SPECX_VLLM_REQ:-vllm==0.32.0}"
TORCH_PIN="${VLLM_SPECX_TORCH_REQ-torch==2.13.0}"
read -r -a EXTRA_PIP <<< "${VLLM_SPECX_PIP_ARGS:-}"

stamp_inputs() {
  cat "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" \
      "$ROOT/scripts/vllm_cpu_requirements.py"
  echo "$VLLM_PIN $TORCH_PIN ${EXTRA_PIP[*]:-}"
}
STAMP="$VENV/.specx-setup-$(stamp_inputs | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ]; then
  return 0 2>/dev/null || exit 0
fi

echo "[setup] creating $VENV (one-time; later runs reuse it)" >&2
# The venv takes about 4.1 GB on a CPU host (triton ~1.0, vLLM ~0.9, torch ~0.8). Say so
# before pip does ("OSError: [Errno 28] No space left on device" half-way through).
NEED_MB=4600
FREE_MB=$(df -Pm "$ROOT" | awk 'NR == 2 {print $4}')
if [ -n "$FREE_MB" ] && [ "$FREE_MB" -lt "$NEED_MB" ]; then
  echo "[setup] warning: ${FREE_MB} MB free on the disk of $ROOT; the set-up needs about" \
       "${NEED_MB} MB for .venv (torch, vLLM, triton). Free some space if pip fails." >&2
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# --no-cache-dir: pip's cache would keep a second copy of every downloaded wheel (vLLM's
# and triton's are hundreds of MB) beside the venv, on disks where space can be short.
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir
     ${EXTRA_PIP[@]+"${EXTRA_PIP[@]}"})

if command -v nvidia-smi >/dev/null 2>&1; then
  "${PIP[@]}" "$VLLM_PIN"
else
  # Install torch first so vLLM's pin is satisfied by the CPU build. vLLM itself comes
  # without its dependencies, then the ones its CPU engine uses
  # (scripts/vllm_cpu_requirements.py): the ~2.5 GB of CUDA-only packages it would pull
  # were most of a fresh clone's set-up time, and its CUDA torchvision/torchaudio/torchcodec
  # break `import vllm` beside a CPU torch.
  if [ -n "$TORCH_PIN" ]; then "${PIP[@]}" "$TORCH_PIN"; fi
  "${PIP[@]}" packaging
  "${PIP[@]}" --no-deps "$VLLM_PIN"
  echo "[setup] vLLM without its CUDA-only packages: pip's lines that vllm 'requires' them" \
       "(tilelang, torchvision, ...) are expected (scripts/vllm_cpu_requirements.py)" >&2
  mapfile -t VLLM_CPU_REQS < <("$VENV/bin/python" "$ROOT/scripts/vllm_cpu_requirements.py")
  "${PIP[@]}" "${VLLM_CPU_REQS[@]}" ${TORCH_PIN:+"$TORCH_PIN"}
  # A venv made before this lean install still holds them; they break `import vllm`.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"${PIP[@]}" -e "$ROOT[test,bench]" ${TORCH_PIN:+"$TORCH_PIN"}
"$VENV/bin/python" -c "import vllm, vllm_specx; print('[setup] vllm', vllm.__version__, 'vllm-specx', vllm_specx.__version__)" >&2
rm -f "$VENV"/.specx-setup-*
touch "$STAMP"
