"""MTAD through vLLM's own LLM API: no vllm-specx import needed.

    python examples/offline_mtad.py [TARGET_DIR DRAFT_DIR]

Defaults to the project's fixture pair (fixtures/models). On a host without an NVIDIA
GPU, run with VLLM_TARGET_DEVICE=cpu (vllm-specx then supplies vLLM's CPU ops).
"""

import sys

from vllm import LLM, SamplingParams


def main() -> None:
    if len(sys.argv) == 3:
        target, draft = sys.argv[1], sys.argv[2]
    else:
        from vllm_specx.fixtures import fixture_model_dirs

        target, draft = map(str, fixture_model_dirs())
    llm = LLM(
        model=target,
        speculative_config={
            "method": "mtad",
            "model": draft,
            "num_speculative_tokens": 4,
            "num_beams": 2,
            "acceptance_threshold": 0.1,
        },
        # CPU engine settings (drop them on a GPU): float32, because the CPU reference
        # ops have no packed-bf16 linear kernels, and a small KV cache.
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
        enforce_eager=True,
    )
    prompts = ["def read_config(path):\n", "class LRUCache:\n    def __init__(self"]
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=48, seed=0)
    for out in llm.generate(prompts, params):
        print("----", repr(out.prompt))
        print(out.prompt + out.outputs[0].text)


if __name__ == "__main__":  # vLLM spawns processes
    main()
