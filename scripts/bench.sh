#!/usr/bin/env bash
# The main job: set-up (first run only), then `vllm-specx bench` with its defaults: the
# real vLLM engine on the platform present, the real pair (SmolLM2-135M-Instruct, fetched
# and converted into the user's cache on first use, and its drafter shipped in the
# package), no speculation vs vLLM's ngram and draft_model vs every available specx
# method. Extra args go to `vllm-specx bench` (see `vllm-specx bench --help`; `--pair
# fixture` for the tests' tiny pair).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec vllm-specx bench "$@"
