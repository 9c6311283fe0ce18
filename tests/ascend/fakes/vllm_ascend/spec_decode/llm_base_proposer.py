"""Mirror of vllm_ascend/spec_decode/llm_base_proposer.py: the proposer base vLLM-Ascend's
runner drives through ``_propose`` (signature as at the mirrored commit; no body)."""


class AscendSpecDecodeBaseProposer:
    def __init__(self, vllm_config, device, pass_hidden_states_to_model: bool, runner=None):
        self.vllm_config = vllm_config
        self.device = device
        self.pass_hidden_states_to_model = pass_hidden_states_to_model
        self.runner = runner

    def load_model(self, model) -> None:
        raise NotImplementedError("fake vllm_ascend: no NPU model loading")

    def _propose(self, num_speculative_tokens, target_token_ids, target_positions,
                 target_hidden_states, next_token_ids, token_indices_to_sample,
                 common_attn_metadata, target_model_batch_desc, sampling_metadata,
                 mm_embed_inputs=None, req_scheduled_tokens=None, long_seq_metadata=None,
                 num_prefill_reqs=0, num_decode_reqs=0, scheduler_output=None,
                 num_scheduled_tokens=0, num_rejected_tokens_gpu=None):
        raise NotImplementedError("fake vllm_ascend: drafting needs an NPU")
