"""Mirror of vllm_ascend/spec_decode/draft_proposer.py: the class name and constructor."""


class AscendDraftModelProposer:
    def __init__(self, vllm_config, device, runner):
        self.vllm_config = vllm_config
        self.device = device
        self.runner = runner
