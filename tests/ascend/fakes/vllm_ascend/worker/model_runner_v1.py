"""Mirror of vllm_ascend/worker/model_runner_v1.py: NPUModelRunner's drafter and sampler
set-up (``_set_up_drafter``, ``_get_drafter``) as at the mirrored commit. The real class
derives from vLLM's GPUModelRunner; that base (and everything else the runner does) is
left out, and __init__ keeps only what _set_up_drafter reads."""

from types import SimpleNamespace

from vllm_ascend.sample.rejection_sampler import AscendRejectionSampler
from vllm_ascend.sample.sampler import AscendSampler
from vllm_ascend.spec_decode import get_spec_decode_method
from vllm_ascend.spec_decode.dspark_proposer import AscendDSparkProposer
from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer
from vllm_ascend.spec_decode.extract_hidden_states_proposer import (
    AscendExtractHiddenStatesProposer,
)

# The real module imports vLLM's get_pp_group; tests set is_last_rank here.
PP_GROUP = SimpleNamespace(is_last_rank=True)


def get_pp_group():
    return PP_GROUP


class NPUModelRunner:
    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.speculative_config = vllm_config.speculative_config
        self.device = device
        self.sampler = AscendSampler()
        self.use_aux_hidden_state_outputs = False
        self._set_up_drafter()

    def _set_up_drafter(self):
        # Set up speculative decoding.
        self.drafter = None
        self.actual_seq_lengths_q = []
        self.decode_token_per_req = 1
        if self.speculative_config:
            spec_token_num = self.speculative_config.num_speculative_tokens
            assert spec_token_num > 0
            self.decode_token_per_req = 1 + spec_token_num
            if get_pp_group().is_last_rank:
                self.drafter = self._get_drafter()
                if self.speculative_config.method == "eagle3":
                    assert isinstance(self.drafter, AscendEagleProposer)
                    self.use_aux_hidden_state_outputs = self.drafter.eagle3_use_aux_hidden_state
                elif self.speculative_config.method == "extract_hidden_states":
                    assert isinstance(self.drafter, AscendExtractHiddenStatesProposer)
                    self.use_aux_hidden_state_outputs = True
                elif self.speculative_config.use_dspark():
                    assert isinstance(self.drafter, AscendDSparkProposer)
                    self.use_aux_hidden_state_outputs = True
                self.rejection_sampler = AscendRejectionSampler(
                    self.sampler, self.speculative_config, self.device
                )

    def _get_drafter(self):
        return get_spec_decode_method(
            self.speculative_config.method, self.vllm_config, self.device, self
        )
