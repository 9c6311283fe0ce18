# Shared by bench.sh and test.sh: set up the venv (once) and pick the platform.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=setup_env.sh
source "$ROOT/scripts/setup_env.sh"
# A host without an NVIDIA GPU runs vLLM's CPU engine (with vllm-specx's reference ops).
if ! command -v nvidia-smi >/dev/null 2>&1; then
  export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"
fi
export PATH="$ROOT/.venv/bin:$PATH"
cd "$ROOT"
