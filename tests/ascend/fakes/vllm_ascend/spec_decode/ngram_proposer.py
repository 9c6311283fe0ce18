"""Mirror of vllm_ascend/spec_decode/ngram_proposer.py: the class name and constructor."""


class AscendNgramProposer:
    def __init__(self, vllm_config, runner):
        self.vllm_config = vllm_config
        self.runner = runner
