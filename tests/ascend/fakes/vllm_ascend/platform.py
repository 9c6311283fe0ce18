"""Mirror of vllm_ascend/platform.py: NPUPlatform's identity and check_and_update_config
(a classmethod that finalises the VllmConfig; here only the ascend config part)."""

from vllm.platforms.interface import Platform

from vllm_ascend.ascend_config import init_ascend_config


class NPUPlatform(Platform):
    device_name: str = "npu"
    device_type: str = "npu"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        init_ascend_config(vllm_config)
