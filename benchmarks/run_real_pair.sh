#!/usr/bin/env bash
# The "Real pair" tables (docs/benchmarks/real-pair.md; plotted by
# benchmarks/plot_real_pair.py): SmolLM2-135M-Instruct (vllm-specx fetch-target) and the
# shipped drafter (vllm_specx/models/smollm2_draft/), no speculation vs draft_model (K=1
# and K=$K), mtad (K=$K, B=2) and adaptive (K=$K) on the held-out prompts
# (vllm_specx/prompts/real_heldout.jsonl), T=0 and T=1, batch 1 and 8.
# Usage: bash benchmarks/run_real_pair.sh [OUT_DIR]   (default: bench-out/real_pair)
# Env:   K (default 2), DRAFT (default: the shipped drafter), NUM_PROMPTS (8), MAX_TOKENS (32),
#        BATCHES ("1 8"), TEMPERATURES ("0 1"), EAGLE3 (the shipped EAGLE-3 head), EAGLE3_K (3),
#        ONLY_EAGLE3=1 (draft_model K=1 and the EAGLE-3 rows only)
# The engines run in the bench's default dtype (vllm_specx.engine.default_dtype: bfloat16 on
# a CPU with native bfloat16); the load average before and after each run goes to
# $OUT/load.txt, since wall-clock numbers on a shared machine mean little without it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
OUT="$(realpath -m "${1:-bench-out/real_pair}")"
mkdir -p "$OUT"
K="${K:-2}"
DRAFT_ARGS=()
if [ -n "${DRAFT:-}" ]; then DRAFT_ARGS=(--draft "$DRAFT"); fi
CFGS=(--config '{"method":"draft_model","num_speculative_tokens":1,"name":"draft_model K=1"}'
      --config "{\"method\":\"draft_model\",\"num_speculative_tokens\":$K,\"name\":\"draft_model K=$K\"}"
      --config "{\"method\":\"mtad\",\"num_speculative_tokens\":$K,\"num_beams\":2,\"name\":\"mtad K=$K B=2\"}"
      --config "{\"method\":\"adaptive\",\"num_speculative_tokens\":$K,\"name\":\"adaptive K=$K\"}")
# The shipped EAGLE-3 head (scripts/build_smollm2_eagle3.sh), when present: vLLM's eagle3
# at K=EAGLE3_K and specx_eagle3 with the adaptive stop (K up to 8) over it.
EAGLE3="${EAGLE3:-vllm_specx/models/smollm2_eagle3}"
EAGLE3_K="${EAGLE3_K:-3}"
if [ -f "$EAGLE3/config.json" ]; then
  EAGLE3="$(realpath "$EAGLE3")"
  CFGS+=(--config "{\"method\":\"eagle3\",\"model\":\"$EAGLE3\",\"num_speculative_tokens\":$EAGLE3_K,\"name\":\"eagle3 K=$EAGLE3_K\"}"
         --config "{\"method\":\"specx_eagle3\",\"model\":\"$EAGLE3\",\"adaptive\":true,\"name\":\"specx_eagle3 adaptive\"}")
fi
if [ -n "${ONLY_EAGLE3:-}" ]; then CFGS=("${CFGS[@]:0:2}" "${CFGS[@]:8}"); fi
for B in ${BATCHES:-1 8}; do for T in ${TEMPERATURES:-0 1}; do
  echo "b=$B T=$T start $(date -u +%H:%M:%S) $(uptime)" | tee -a "$OUT/load.txt"
  vllm-specx bench --pair real ${DRAFT_ARGS[@]+"${DRAFT_ARGS[@]}"} --temperature "$T" \
    --ignore-eos --no-plots --num-prompts "${NUM_PROMPTS:-8}" --max-tokens "${MAX_TOKENS:-32}" \
    --engine-args "{\"max_num_seqs\": $B, \"kv_cache_memory_bytes\": 268435456}" \
    -o "$OUT/real_T${T}_b${B}.json" "${CFGS[@]}"
  echo "b=$B T=$T end   $(date -u +%H:%M:%S) $(uptime)" | tee -a "$OUT/load.txt"
done; done
