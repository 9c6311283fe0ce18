#!/usr/bin/env bash
# vLLM's own tests (rejection sampler, v1/spec_decode, V1 scheduler, GPU model runner,
# speculative config) run twice, with vllm-specx loaded and left out; fails on any test
# that passes without the plugin and fails with it. See scripts/upstream_vllm/run.py.
#
# Usage: bash scripts/upstream_vllm_tests.sh [--subset full|fast] [--keep DIR] [-- pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python "$ROOT/scripts/upstream_vllm/run.py" "$@"
