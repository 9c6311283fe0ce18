"""Mirror of vllm_ascend/spec_decode/step3p5.py: the class name and constructor."""


class AscendStep3p5MTPProposer:
    def __init__(self, vllm_config, device, runner):
        self.vllm_config = vllm_config
        self.device = device
        self.runner = runner
