"""Mirror of vllm_ascend/spec_decode/ngram_proposer_npu.py: the class name and constructor."""


class AscendNgramProposerNPU:
    def __init__(self, vllm_config, device, runner):
        self.vllm_config = vllm_config
        self.device = device
        self.runner = runner
