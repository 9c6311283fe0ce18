"""Mirror of vllm_ascend/spec_decode/extract_hidden_states_proposer.py: the class name
and constructor."""


class AscendExtractHiddenStatesProposer:
    def __init__(self, vllm_config, device, runner):
        self.vllm_config = vllm_config
        self.device = device
        self.runner = runner
