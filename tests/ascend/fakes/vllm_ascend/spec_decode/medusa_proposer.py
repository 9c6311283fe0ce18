"""Mirror of vllm_ascend/spec_decode/medusa_proposer.py: the class name and constructor."""


class AscendMedusaProposer:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = device
