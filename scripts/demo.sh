#!/usr/bin/env bash
# The main job: set-up (first run only), then the vllm-specx demo on this platform.
# Extra args go to `vllm-specx demo`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec vllm-specx demo "$@"
