#!/usr/bin/env bash
# An OpenAI-compatible server with MTAD, then one completion request.
#   bash examples/serve_mtad.sh [TARGET_DIR DRAFT_DIR]
# Defaults to the fixture pair; on a host without an NVIDIA GPU it uses vLLM's CPU engine.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${1:-fixtures/models/target}"
DRAFT="${2:-fixtures/models/draft}"
command -v nvidia-smi >/dev/null || export VLLM_TARGET_DEVICE=cpu
vllm serve "$TARGET" --host 127.0.0.1 --port 8000 --enforce-eager --dtype float32 \
  --kv-cache-memory-bytes $((256 << 20)) \
  --speculative-config "{\"method\": \"mtad\", \"model\": \"$DRAFT\", \"num_speculative_tokens\": 4, \"num_beams\": 2}" &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 2; done
curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$TARGET\", \"prompt\": \"def main(\", \"max_tokens\": 32, \"temperature\": 0}"
echo
curl -s http://127.0.0.1:8000/metrics | grep -E '^vllm:spec_decode_num_(drafts|accepted_tokens)_total'
