"""Mirror of vllm_ascend/ascend_config.py: get_ascend_config() and the two settings the
rejection sampler reads (enable_reduce_sample, rejection_sampler_config)."""

from types import SimpleNamespace

_config = None


def init_ascend_config(vllm_config):
    global _config
    extra = getattr(vllm_config, "additional_config", None) or {}
    sampler = extra.get("rejection_sampler_config", {})
    _config = SimpleNamespace(
        enable_reduce_sample=extra.get("enable_reduce_sample", False),
        rejection_sampler_config=SimpleNamespace(
            enable_block_verify=sampler.get("enable_block_verify", False),
            enable_entropy_verify=sampler.get("enable_entropy_verify", False),
        ),
    )
    return _config


def get_ascend_config():
    return _config if _config is not None else init_ascend_config(None)
