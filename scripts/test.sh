#!/usr/bin/env bash
# The full test suite: set-up (first run only), ruff, then pytest. Extra args go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# Inductor's compiled kernels (vLLM compiles a few helpers even on CPU, e.g. the
# vocab-parallel embedding's mask at tensor parallel 2) cached per CPU capability: a cache
# filled under one ATEN_CPU_CAPABILITY and read under another gave the TP tests an
# out-of-range embedding index (AVX2 simulation after a native run on one host,
# 2026-11-27); each capability now compiles its own. TORCHINDUCTOR_CACHE_DIR set wins.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/torchinductor-${ATEN_CPU_CAPABILITY:-native}}"
echo "[test] ruff check" >&2
ruff check .
set +e
# Two pytest-xdist workers, one test directory per worker at a time (tests/conftest.py groups
# them): most tests drive one single-threaded engine, so the two cores run two directories
# at once. VLLM_SPECX_TEST_WORKERS=0 runs everything in this process. --durations=30 lists the
# slowest tests at the end: the suite must stay under 20 minutes on 2 cores, so every run
# (CI's included) says where the time goes.
python -m pytest -n "${VLLM_SPECX_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder \
    --durations=30 "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a failure of this script's purpose.
if [ "$rc" -eq 5 ]; then echo "[test] no tests were collected" >&2; exit 1; fi
exit "$rc"
