#!/usr/bin/env bash
# The benchmark runs behind the fixture-pair tables of the docs (docs/benchmarks/, docs/methods/;
# once the README's, hence the name), on the fixture pair and the platform present.
# Usage: bash benchmarks/run_readme_benchmarks.sh [OUT_DIR]   (default: bench-out/readme)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
# These tables are the fixture pair's (`vllm-specx bench` defaults to the real pair).
export VLLM_SPECX_BENCH_PAIR=fixture
# They were measured in float32 (the engines' default before bfloat16 became the default on
# CPUs with native bfloat16); set VLLM_SPECX_CPU_DTYPE to measure another dtype.
export VLLM_SPECX_CPU_DTYPE="${VLLM_SPECX_CPU_DTYPE:-float32}"
OUT="$(realpath -m "${1:-bench-out/readme}")"
mkdir -p "$OUT"
DM='{"method":"draft_model","num_speculative_tokens":%s,"name":"draft_model K=%s"}'

# 1. vLLM's own methods: no speculation, draft_model K=2/4/8, ngram; greedy and T=1.
for T in 0 1; do
  vllm-specx bench --temperature "$T" --ignore-eos -o "$OUT/vllm_methods_T$T.json" \
    --config "$(printf "$DM" 2 2)" --config "$(printf "$DM" 4 4)" --config "$(printf "$DM" 8 8)" \
    --config '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2,"name":"ngram K=4"}'
done

# 2. MTAD at T=1, top-k 20, top-p 0.9 (the paper's setting), K=4, against vLLM's
#    draft_model with greedy drafts (its default) and with sampled drafts (speculative
#    sampling, the paper's baseline). 8 prompts (one batch); the docs' table is
#    `python benchmarks/mtad_table.py --cost-ratio 0.3 "$OUT/mtad_T1.json"`.
CFGS=(--config "$(printf "$DM" 4 4)"
      --config '{"method":"draft_model","num_speculative_tokens":4,"draft_sample_method":"probabilistic","name":"spec. sampling K=4"}')
for B in 1 2 4 8; do for TAU in 0.05 0.1 0.3 0.5 0.9; do
  CFGS+=(--config "{\"method\":\"mtad\",\"num_speculative_tokens\":4,\"num_beams\":$B,\"acceptance_threshold\":$TAU,\"name\":\"mtad B=$B tau=$TAU\"}")
done; done
vllm-specx bench --temperature 1 --top-k 20 --top-p 0.9 --num-prompts 8 --ignore-eos \
  -o "$OUT/mtad_T1.json" "${CFGS[@]}"

# 3. MTAD at T=0: greedy requests are verified greedily (tau has no effect), so only B.
CFGS=(--config "$(printf "$DM" 4 4)")
for B in 1 2 4 8; do
  CFGS+=(--config "{\"method\":\"mtad\",\"num_speculative_tokens\":4,\"num_beams\":$B,\"name\":\"mtad B=$B\"}")
done
vllm-specx bench --temperature 0 --ignore-eos -o "$OUT/mtad_T0.json" "${CFGS[@]}"

# 4. MTAD draft cost per round for K in {2,4,8}, B in {1,2,4,8}.
python tests/mtad/measure_draft_cost.py --max-tokens 32 --json "$OUT/mtad_draft_cost.json" | tee "$OUT/mtad_draft_cost.md"

# 5. MTAD with drafts whose tokenizer differs from the target's (use_heterogeneous_vocab):
#    the fixture draft under other ids (+16 draft-only tokens), and the same with 64
#    tokens of the held-out prompts missing; vLLM's draft_model (greedy drafts, the only
#    kind it supports with another tokenizer) alongside.
python - "$OUT/hetero" <<'PY'
import sys
from vllm_specx.fixtures import fixture_model_dirs, heldout_prompts
from vllm_specx.testing.tiny_models import make_heterogeneous_vocab_draft
_, draft = fixture_model_dirs()
make_heterogeneous_vocab_draft(draft, f"{sys.argv[1]}/renumbered", seed=0)
make_heterogeneous_vocab_draft(draft, f"{sys.argv[1]}/missing64", seed=1, drop_tokens=64,
                               drop_from_text="\n".join(heldout_prompts(16)))
PY
H='"use_heterogeneous_vocab":true'
for T in 0 1; do
  vllm-specx bench --temperature "$T" --top-k 20 --top-p 0.9 --num-prompts 16 --ignore-eos \
    -o "$OUT/mtad_hetero_T$T.json" \
    --config '{"method":"mtad","name":"mtad, same tokenizer"}' \
    --config "{\"method\":\"mtad\",\"model\":\"$OUT/hetero/renumbered\",$H,\"name\":\"mtad, renumbered\"}" \
    --config "{\"method\":\"mtad\",\"model\":\"$OUT/hetero/missing64\",$H,\"name\":\"mtad, 64 missing\"}" \
    --config "$(printf "$DM" 4 4)" \
    --config "{\"method\":\"draft_model\",\"num_speculative_tokens\":4,\"model\":\"$OUT/hetero/missing64\",$H,\"name\":\"draft_model K=4, 64 missing\"}"
done

# 6. Adaptive-length drafting (SpecDec++ stop, EMS-SD unpadded batches) against fixed K:
#    batch 8 (8 prompts), batch 1 and batch 32 (32 prompts); T=0 and T=1. Every row also
#    reports the SpecDec++ hindsight oracle (oracle_projected_speedup) and the padding
#    ratio; benchmarks/adaptive_table.py re-projects each report with one draft/target
#    cost ratio (0.30, measured on a quiet 2-core host) and prints the docs' tables.
HEAD="$(python -c 'from vllm_specx.fixtures import fixtures_root; print(fixtures_root() / "head")')"
SS='{"method":"draft_model","num_speculative_tokens":%s,"draft_sample_method":"probabilistic","name":"spec. sampling K=%s"}'
AD='{"method":"adaptive","num_speculative_tokens":%s,%s,"name":"%s"}'
HD="\"acceptance_head\":\"$HEAD\",\"stop_threshold\""
CFGS=()
for K in 1 2 3 4 6 8; do CFGS+=(--config "$(printf "$DM" "$K" "$K")"); done
for C in 0.3 0.5 0.7; do CFGS+=(--config "$(printf "$AD" 8 "\"confidence_threshold\":$C" "adaptive conf=$C")"); done
CFGS+=(--config "$(printf "$AD" 8 '"confidence_threshold":0.5,"confidence_signal":"top2_margin"' "adaptive margin=0.5")"
       --config "$(printf "$AD" 12 '"confidence_threshold":0.5' "adaptive K=12 conf=0.5")")
for H in 0.7 0.95; do CFGS+=(--config "$(printf "$AD" 8 "$HD:$H" "adaptive head h=$H")"); done
vllm-specx bench --temperature 0 --ignore-eos --no-plots -o "$OUT/adaptive_T0_b8.json" "${CFGS[@]}"
CFGS=()
for K in 1 2 4 8; do CFGS+=(--config "$(printf "$DM" "$K" "$K")"); done
for K in 1 2 3 4 6 8; do CFGS+=(--config "$(printf "$SS" "$K" "$K")"); done
for C in 0.1 0.3 0.5; do CFGS+=(--config "$(printf "$AD" 8 "\"confidence_threshold\":$C" "adaptive conf=$C")"); done
CFGS+=(--config "$(printf "$AD" 8 '"confidence_threshold":0.5,"confidence_signal":"max_prob"' "adaptive max_prob=0.5")"
       --config "$(printf "$AD" 8 '"confidence_threshold":0.5,"draft_sampling":"greedy"' "adaptive conf=0.5 greedy drafts")")
for H in 0.5 0.7 0.9 0.98; do CFGS+=(--config "$(printf "$AD" 8 "$HD:$H" "adaptive head h=$H")"); done
vllm-specx bench --temperature 1 --ignore-eos --no-plots -o "$OUT/adaptive_T1_b8.json" "${CFGS[@]}"
B1='{"max_num_seqs": 1}'
vllm-specx bench --temperature 0 --ignore-eos --no-plots --engine-args "$B1" -o "$OUT/adaptive_T0_b1.json" \
  --config "$(printf "$DM" 4 4)" --config "$(printf "$DM" 6 6)" \
  --config "$(printf "$AD" 8 '"confidence_threshold":0.5' "adaptive conf=0.5")" \
  --config "$(printf "$AD" 8 "$HD:0.7" "adaptive head h=0.7")" --config "$(printf "$AD" 8 "$HD:0.95" "adaptive head h=0.95")"
vllm-specx bench --temperature 1 --ignore-eos --no-plots --engine-args "$B1" -o "$OUT/adaptive_T1_b1.json" \
  --config "$(printf "$SS" 1 1)" --config "$(printf "$SS" 2 2)" \
  --config "$(printf "$AD" 8 '"confidence_threshold":0.5' "adaptive conf=0.5")" \
  --config "$(printf "$AD" 8 "$HD:0.7" "adaptive head h=0.7")"
vllm-specx bench --temperature 0 --ignore-eos --no-plots --num-prompts 32 --engine-args '{"max_num_seqs": 32}' \
  -o "$OUT/adaptive_T0_b32.json" --config "$(printf "$DM" 4 4)" \
  --config "$(printf "$AD" 8 '"confidence_threshold":0.5' "adaptive conf=0.5")"
python benchmarks/adaptive_table.py --cost-ratio 0.30 "$OUT"/adaptive_T*_b*.json | tee "$OUT/adaptive_tables.md"

# 7. specx_mtp on the MTP fixture (fixtures/models/mtp_target, greedy): vLLM's mtp and
#    specx_mtp at K=1..4 (and vLLM's mtp at K=8), specx_mtp adaptive K=8 at the default
#    confidence threshold (0.2) and at 0.5, 0.3, 0.1 (and T=1); the docs' numbers are
#    from benchmarks/adaptive_table.py (one cost ratio per report), run below.
MTPT="$(python -c 'from vllm_specx.fixtures import fixtures_root; print(fixtures_root() / "mtp_target")')"
CFGS=()
for K in 1 2 3 4 8; do CFGS+=(--config "{\"method\":\"mtp\",\"num_speculative_tokens\":$K,\"name\":\"mtp K=$K\"}"); done
for K in 1 2 3 4; do CFGS+=(--config "{\"method\":\"specx_mtp\",\"num_speculative_tokens\":$K,\"name\":\"specx_mtp K=$K\"}"); done
CFGS+=(--config '{"method":"specx_mtp","num_speculative_tokens":8,"adaptive":true,"name":"specx_mtp K=8 adaptive"}')
for C in 0.5 0.3 0.1; do
  CFGS+=(--config "{\"method\":\"specx_mtp\",\"num_speculative_tokens\":8,\"adaptive\":true,\"confidence_threshold\":$C,\"name\":\"specx_mtp K=8 adaptive conf=$C\"}")
done
vllm-specx bench --pair fixture --target "$MTPT" --temperature 0 --ignore-eos --max-tokens 64 \
  --num-prompts 8 --no-plots -o "$OUT/mtp_T0.json" "${CFGS[@]}"
CFGS=()
for K in 1 2 4; do CFGS+=(--config "{\"method\":\"mtp\",\"num_speculative_tokens\":$K,\"name\":\"mtp K=$K\"}"); done
for C in 0.5 0.3 0.2 0.1; do
  CFGS+=(--config "{\"method\":\"specx_mtp\",\"num_speculative_tokens\":8,\"adaptive\":true,\"confidence_threshold\":$C,\"name\":\"specx_mtp K=8 adaptive conf=$C\"}")
done
vllm-specx bench --pair fixture --target "$MTPT" --temperature 1 --ignore-eos --max-tokens 64 \
  --num-prompts 8 --no-plots -o "$OUT/mtp_T1.json" "${CFGS[@]}"
python benchmarks/adaptive_table.py "$OUT/mtp_T0.json" "$OUT/mtp_T1.json" | tee "$OUT/mtp_tables.md"
