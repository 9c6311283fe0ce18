"""Mirror of vllm_ascend/spec_decode/eagle_proposer.py (the real class also derives from
vLLM's EagleProposer; its constructor is AscendSpecDecodeBaseProposer's)."""

from vllm_ascend.spec_decode.llm_base_proposer import AscendSpecDecodeBaseProposer


class AscendEagleProposer(AscendSpecDecodeBaseProposer):
    eagle3_use_aux_hidden_state = True  # set by vLLM's EagleProposer in the real class

    def __init__(self, vllm_config, device, runner=None):
        AscendSpecDecodeBaseProposer.__init__(self, vllm_config, device, True, runner=runner)
