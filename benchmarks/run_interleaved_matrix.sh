#!/usr/bin/env bash
# The default configurations against no speculation at batch 1, 8 and 32, T = 0 and 1, on
# the real pair, each cell one run of benchmarks/interleaved_speedup.py (every engine
# alive in one process, the timed runs interleaved with no speculation's, every engine
# warmed): the matrix behind the README's "Does it pay?" table (issue 32's aim: every
# specx default >= 0.97x of no speculation, vLLM's own methods beside them).
#
# Rows: specx_eagle3 {"adaptive": true}, adaptive and mtad (K = 4, B = 4) as a user writes
# them (cost control on by default; adaptive's K = 8 by default), vLLM's eagle3 K=3 and
# draft_model K=1 (the shipped head and drafter), and a second no-speculation engine
# started last ("none again"): the same work as the baseline, so its distance from 1.00x
# is what the host and the engines' order alone do to a row in that cell (read every
# row's speed-up against it).
# Usage: bash benchmarks/run_interleaved_matrix.sh [OUT_DIR]   (default: bench-out/matrix)
# Env:   BATCHES ("1 8 32"), TEMPERATURES ("0 1"), MAX_TOKENS (64), REPEATS (2),
#        EAGLE3 (the shipped EAGLE-3 head)
# Each cell writes $OUT/bB_tT.json and .log; the load average before and after goes to
# $OUT/load.txt. About 35 minutes on a 2-core CPU host.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
OUT="$(realpath -m "${1:-bench-out/matrix}")"
mkdir -p "$OUT"
EAGLE3="$(realpath "${EAGLE3:-vllm_specx/models/smollm2_eagle3}")"
CFGS=(--config "{\"method\":\"specx_eagle3\",\"model\":\"$EAGLE3\",\"adaptive\":true,\"name\":\"specx_eagle3 adaptive\"}"
      --config '{"method":"adaptive","name":"adaptive"}'
      --config '{"method":"mtad","num_speculative_tokens":4,"name":"mtad K=4"}'
      --config "{\"method\":\"eagle3\",\"model\":\"$EAGLE3\",\"num_speculative_tokens\":3,\"name\":\"eagle3 K=3 (vLLM)\"}"
      --config '{"method":"draft_model","num_speculative_tokens":1,"name":"draft_model K=1 (vLLM)"}'
      --config '{"method":"none","name":"none again"}')
for B in ${BATCHES:-1 8 32}; do for T in ${TEMPERATURES:-0 1}; do
  # Batch 1 runs 8 prompts one after another; a larger batch runs one closed batch.
  P=$(( B > 8 ? B : 8 ))
  echo "b=$B T=$T start $(date -u +%H:%M:%S) $(uptime)" | tee -a "$OUT/load.txt"
  python "$(dirname "${BASH_SOURCE[0]}")/interleaved_speedup.py" --pair real --batch "$B" \
    --prompts "$P" --max-tokens "${MAX_TOKENS:-64}" --temperature "$T" \
    --repeats "${REPEATS:-2}" "${CFGS[@]}" -o "$OUT/b${B}_t${T}.json" > "$OUT/b${B}_t${T}.log" 2>&1
  grep -E "^(none|specx|adaptive|mtad|eagle3|draft_model)" "$OUT/b${B}_t${T}.log" || true
  echo "b=$B T=$T end   $(date -u +%H:%M:%S) $(uptime)" | tee -a "$OUT/load.txt"
done; done
