"""Device-independent algorithms of vllm-specx, in pure PyTorch (no vLLM import).

``verify``: the extended rejection sampler (standard, one-hot, greedy and MTAD rules)
that every speculative method of the plugin is verified by.
"""
