#!/usr/bin/env bash
# Chains against draft trees on the real pair, on a CUDA GPU (issues 34 and 37): no speculation,
# vLLM's eagle3 and draft_model at K = 3, specx_eagle3 as a K = 3 chain and as the trees of
# docs/trees.md (8/4/2 and 16/5/4) over the shipped EAGLE-3 head, specx_eagle3 "adaptive" and
# adaptive K = 3 (cost control on: their defaults, issue 32), and adaptive's draft-model tree 8/3/3; the held-out prompts, --ignore-eos, bfloat16, eager, vLLM's V1 runner unless
# RUNNER=v2 (draft trees on CUDA run on the V1 runner; docs/trees.md "On CUDA and Ascend").
# On a CPU the same script runs the CPU engine (slowly); the tables in docs/benchmarks/gpu.md
# came from it on the lent GPU machine (../shared/hooks/gpu-kit, `run.sh`).
# Usage: bash benchmarks/gpu_trees.sh [OUT_DIR]        (default: bench-out/gpu_trees)
# Env:   BATCHES ("1"), TEMPERATURES ("0"), NUM_PROMPTS (8), MAX_TOKENS (64), RUNNER (v1),
#        GPU_MEM (gpu_memory_utilization, 0.3), EAGER (enforce_eager for every engine, "true";
#        "false" lets vLLM capture CUDA graphs where the config allows: tree configs stay eager), ONLY (an extended regular expression: run only
#        the configs whose JSON matches it, the baseline always), TAG (suffix of the report's
#        name, e.g. "_graphs"), EAGLE3 / DRAFT (the head and the drafter:
#        default the shipped vllm_specx/models/smollm2_eagle3 and smollm2_draft)
set -euo pipefail
OUT="$(realpath -m "${1:-bench-out/gpu_trees}")"
mkdir -p "$OUT"
if [ "${RUNNER:-v1}" = v1 ]; then export VLLM_USE_V2_MODEL_RUNNER=0; fi
HEAD="$(realpath "${EAGLE3:-vllm_specx/models/smollm2_eagle3}")"
DRAFT="$(realpath "${DRAFT:-vllm_specx/models/smollm2_draft}")"
E3="\"model\":\"$HEAD\""
ALL=(
  "{\"method\":\"eagle3\",$E3,\"num_speculative_tokens\":3,\"name\":\"eagle3 K=3\"}"
  "{\"method\":\"specx_eagle3\",$E3,\"num_speculative_tokens\":3,\"name\":\"specx_eagle3 K=3 chain\"}"
  "{\"method\":\"specx_eagle3\",$E3,\"draft_tree\":{\"max_nodes\":8,\"max_depth\":4,\"branching\":2},\"name\":\"specx_eagle3 tree 8/4/2\"}"
  "{\"method\":\"specx_eagle3\",$E3,\"draft_tree\":{\"max_nodes\":16,\"max_depth\":5,\"branching\":4},\"name\":\"specx_eagle3 tree 16/5/4\"}"
  "{\"method\":\"specx_eagle3\",$E3,\"num_speculative_tokens\":3,\"adaptive\":true,\"name\":\"specx_eagle3 adaptive K=3\"}"
  "{\"method\":\"draft_model\",\"num_speculative_tokens\":3,\"name\":\"draft_model K=3\"}"
  "{\"method\":\"adaptive\",\"num_speculative_tokens\":3,\"name\":\"adaptive K=3\"}"
  "{\"method\":\"adaptive\",\"draft_tree\":{\"max_nodes\":8,\"max_depth\":3,\"branching\":3},\"name\":\"adaptive tree 8/3/3\"}"
)
CFGS=()
for c in "${ALL[@]}"; do
  if grep -Eq -- "${ONLY:-.}" <<< "$c"; then CFGS+=(--config "$c"); fi
done
for B in ${BATCHES:-1}; do for T in ${TEMPERATURES:-0}; do
  echo "b=$B T=$T start $(date -u +%H:%M:%S) runner=${RUNNER:-v1}"
  python3 -m vllm_specx.cli bench --pair real --draft "$DRAFT" --temperature "$T" --ignore-eos --no-plots \
    --num-prompts "${NUM_PROMPTS:-8}" --max-tokens "${MAX_TOKENS:-64}" \
    --engine-args "{\"max_num_seqs\": $B, \"dtype\": \"bfloat16\", \"enforce_eager\": ${EAGER:-true}, \"gpu_memory_utilization\": ${GPU_MEM:-0.3}}" \
    -o "$OUT/gpu_T${T}_b${B}${TAG:-}.json" "${CFGS[@]}"
  echo "b=$B T=$T end   $(date -u +%H:%M:%S)"
done; done
