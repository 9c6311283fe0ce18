#!/usr/bin/env bash
# Cost control and per-step parity on a CUDA GPU (issue 32), in one time-boxed run: the real pair
# (SmolLM2-135M-Instruct, its shipped draft model and EAGLE-3 head), bfloat16, eager, vLLM's default
# model runner (V2 on a GPU) unless RUNNER=v1, the held-out prompts, --ignore-eos, T = 0. Stages, most
# wanted first; a stage starts only if its minimum fits in what is left of BUDGET_S:
#   bench_b1  `vllm-specx bench --batch-sizes 1`: no speculation (before and after), vLLM's eagle3 K=3,
#             specx_eagle3 "adaptive" and adaptive, each with cost control on (their default) and off
#   parity_e3 benchmarks/round_parity.py --eagle3 -k 3: vLLM's eagle3 against specx_eagle3 at equal
#             drafts, interleaved repeats in one process (wall ms per decode step)
#   bench_b8  as bench_b1 at batch 8
#   parity_dm benchmarks/round_parity.py -k 3: draft_model against adaptive and mtad (B = 1) at equal
#             drafts
# Stages on request (STAGES="varlen_b1 plain_b1 graphs_b1 graphs_b8 inter_b1 inter_b8", say), each
# benchmarks/interleaved_speedup.py with every row's engine alive and the timed runs interleaved:
#   graphs_b1 batch 1 in vLLM's default mode (CUDA graphs, compiled: what `vllm serve` runs): vLLM's eagle3
#             K=3, specx_eagle3 "adaptive" (cost control on) and K=3, adaptive; a row that fails to start
#             is reported with its error
#   graphs_b8 the same at batch 8 (8 prompts)
#   plain_b1  graphs_b1 with VLLM_SPECX_V2_PLAIN_STEP_GRAPHS=1 (FULL graphs for the ragged methods'
#             plain steps; opt-in until a GPU run shows it lossless): eagle3 K=3, specx_eagle3
#             "adaptive", adaptive
#   varlen_b1 graphs_b1 with VLLM_SPECX_V2_VARLEN_GRAPHS=1 (vLLM's varlen decode graphs for the ragged
#             methods' every decode step, plain or drafting; opt-in until a GPU run shows it lossless):
#             eagle3 K=3, specx_eagle3 "adaptive", adaptive
#   inter_b1  batch 1, eager: no speculation with synchronous scheduling, eagle3 K=3, specx_eagle3
#             "adaptive", adaptive (cost control on)
#   inter_b8  batch 8 (8 prompts), eager: eagle3 K=3, specx_eagle3 "adaptive", adaptive
# Every stage's log and report land in OUT_DIR; at the end they are packed into OUT_DIR/gpu_cost.tgz and
# each report's markdown table is printed (PACK_TO names the archive). docs/benchmarks/gpu.md has the
# numbers it gave.
# Usage: bash benchmarks/gpu_cost.sh [OUT_DIR]     (default: bench-out/gpu_cost)
# Env:   STAGES ("bench_b1 parity_e3 bench_b8 parity_dm"), PACK_TO (OUT_DIR/gpu_cost.tgz), BUDGET_S (540), RUNNER (v2 | v1), NUM_PROMPTS (8), MAX_TOKENS (64),
#        GPU_MEM (0.2),
#        EAGER ("true"; "false" lets vLLM capture CUDA graphs where a config allows)
set -uo pipefail
OUT="$(realpath -m "${1:-bench-out/gpu_cost}")"
mkdir -p "$OUT"
PACK_TO="$(realpath -m "${PACK_TO:-$OUT/gpu_cost.tgz}")"
if [ "${RUNNER:-v2}" = v1 ]; then export VLLM_USE_V2_MODEL_RUNNER=0; fi
BUDGET=${BUDGET_S:-540}
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }

# stage NAME MIN_SECONDS COMMAND...: run COMMAND (output to OUT/NAME.log) if MIN_SECONDS fit, cut at the
# budget's end.
stage() {
  local name=$1 need=$2 l rc
  shift 2
  l=$(left)
  if [ "$l" -lt "$need" ]; then
    echo "== $name skipped: ${l}s left, needs ${need}s"
    return 0
  fi
  echo "== $name start $(date -u +%H:%M:%S) (${l}s left)"
  timeout -k 5 "$l" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name exit $rc end $(date -u +%H:%M:%S)"
  tail -n 20 "$OUT/$name.log"
  pack
}

# Everything so far into one archive after every stage, so a run cut short still leaves its results
# (the GPU machine hands back few files: PACK_TO=$OUT/gpu_cost.tgz there).
pack() {
  tar -C "$OUT" -czf "$PACK_TO.tmp" --exclude '*.tgz*' . && mv "$PACK_TO.tmp" "$PACK_TO"
}

# On the GPU kit's machine the checkout travels without vllm_specx/models (slim.sh) and the
# kit links its staged copy in; if that link is missing (seen 2026-11-27: an empty folder was
# there first), link it here rather than fail every stage on the missing drafter.
KIT_MODELS="${KIT_DEV_ROOT:-/nonexistent}/real/vllm_specx/models"
if [ ! -f vllm_specx/models/smollm2_draft/config.json ] && [ -d "$KIT_MODELS/smollm2_draft" ]; then
  rm -rf vllm_specx/models && ln -s "$KIT_MODELS" vllm_specx/models
  echo "gpu_cost: linked vllm_specx/models -> $KIT_MODELS"
fi
HEAD="$(realpath vllm_specx/models/smollm2_eagle3)"
EA="{\"dtype\": \"bfloat16\", \"enforce_eager\": ${EAGER:-true}, \"gpu_memory_utilization\": ${GPU_MEM:-0.2}}"
CONFIGS=(
  --config "{\"method\": \"eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": 3, \"name\": \"eagle3 K=3\"}"
  --config "{\"method\": \"specx_eagle3\", \"model\": \"$HEAD\", \"adaptive\": true, \"name\": \"specx_eagle3 adaptive\"}"
  --config "{\"method\": \"adaptive\", \"name\": \"adaptive\"}"
)
# (timeout runs programs, not shell functions: the commands are arrays)
BENCH=(python3 -m vllm_specx.cli bench --pair real --temperature 0 --ignore-eos --no-plots
  --num-prompts "${NUM_PROMPTS:-8}" --max-tokens "${MAX_TOKENS:-64}" --engine-args "$EA"
  -o "$OUT/bench.json" "${CONFIGS[@]}")
PARITY=(python3 benchmarks/round_parity.py --pair real -k 3 --prompts 4
  --max-tokens "${MAX_TOKENS:-64}" --repeats 3 --engine-args "$EA")

# benchmarks/interleaved_speedup.py: every row's engine alive at once, timed runs interleaved with
# no speculation's; a row whose engine fails to start is reported, not fatal.
INTER=(python3 benchmarks/interleaved_speedup.py --pair real --temperature 0 --continue-on-error
  --max-tokens "${MAX_TOKENS:-64}")
I_EAGER="{\"dtype\": \"bfloat16\", \"enforce_eager\": true, \"gpu_memory_utilization\": 0.1}"
I_GRAPHS="{\"dtype\": \"bfloat16\", \"enforce_eager\": false, \"gpu_memory_utilization\": 0.1}"
E3_ON="{\"method\": \"specx_eagle3\", \"model\": \"$HEAD\", \"adaptive\": true, \"name\": \"specx_eagle3 adaptive\"}"
E3_K3="{\"method\": \"eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": 3, \"name\": \"eagle3 K=3\"}"
SX_K3="{\"method\": \"specx_eagle3\", \"model\": \"$HEAD\", \"num_speculative_tokens\": 3, \"name\": \"specx_eagle3 K=3\"}"
AD_ON='{"method": "adaptive", "name": "adaptive"}'
SYNC='{"method": "none", "engine_args": {"async_scheduling": false}, "name": "none, synchronous"}'

run_stage() {
  case $1 in
    bench_b1) stage bench_b1 200 "${BENCH[@]}" --batch-sizes 1 ;;
    parity_e3) stage parity_e3 80 "${PARITY[@]}" --eagle3 ;;
    bench_b8) stage bench_b8 150 "${BENCH[@]}" --batch-sizes 8 ;;
    parity_dm) stage parity_dm 100 "${PARITY[@]}" ;;
    # vLLM's default mode (CUDA graphs, compiled), which `vllm serve` users run: every method starts?
    graphs_b1) stage graphs_b1 150 "${INTER[@]}" --batch 1 --prompts 4 --repeats 3 \
      --engine-args "$I_GRAPHS" -o "$OUT/graphs_b1.json" \
      --config "$E3_K3" --config "$E3_ON" --config "$SX_K3" --config "$AD_ON" ;;
    graphs_b8) stage graphs_b8 120 "${INTER[@]}" --batch 8 --prompts 8 --repeats 3 \
      --engine-args "$I_GRAPHS" -o "$OUT/graphs_b8.json" \
      --config "$E3_K3" --config "$E3_ON" --config "$SX_K3" --config "$AD_ON" ;;
    # graphs_b1 with the opt-in FULL graphs for the ragged methods' plain steps
    # (VLLM_SPECX_V2_PLAIN_STEP_GRAPHS=1, glue/v2_patches.add_plain_step_graphs)
    plain_b1) stage plain_b1 150 env VLLM_SPECX_V2_PLAIN_STEP_GRAPHS=1 "${INTER[@]}" --batch 1 \
      --prompts 4 --repeats 3 --engine-args "$I_GRAPHS" -o "$OUT/plain_b1.json" \
      --config "$E3_K3" --config "$E3_ON" --config "$AD_ON" ;;
    # graphs_b1 with the opt-in varlen decode graphs (VLLM_SPECX_V2_VARLEN_GRAPHS=1,
    # glue/v2_patches.use_varlen_decode_graphs)
    varlen_b1) stage varlen_b1 150 env VLLM_SPECX_V2_VARLEN_GRAPHS=1 "${INTER[@]}" --batch 1 \
      --prompts 4 --repeats 3 --engine-args "$I_GRAPHS" -o "$OUT/varlen_b1.json" \
      --config "$E3_K3" --config "$E3_ON" --config "$AD_ON" ;;
    inter_b1) stage inter_b1 150 "${INTER[@]}" --batch 1 --prompts 4 --repeats 3 \
      --engine-args "$I_EAGER" -o "$OUT/inter_b1.json" \
      --config "$SYNC" --config "$E3_K3" --config "$SX_K3" --config "$E3_ON" --config "$AD_ON" ;;
    inter_b8) stage inter_b8 100 "${INTER[@]}" --batch 8 --prompts 8 --repeats 3 \
      --engine-args "$I_EAGER" -o "$OUT/inter_b8.json" \
      --config "$E3_K3" --config "$E3_ON" --config "$AD_ON" ;;
    *) echo "== unknown stage $1" ;;
  esac
}

echo "gpu_cost: $(date -u +%H:%M:%S) runner=${RUNNER:-v2} budget=${BUDGET}s engine args $EA"
for s in ${STAGES:-bench_b1 parity_e3 bench_b8 parity_dm}; do run_stage "$s"; done
for md in "$OUT"/bench_b*.md "$OUT"/bench_batch_sweep.md; do
  [ -f "$md" ] && { echo "== $md"; cat "$md"; }
done
pack && echo "packed $PACK_TO"
echo "gpu_cost: done $(date -u +%H:%M:%S)"
