"""The chain pass's set-up in torch ops (``LookaheadPasses._chain_step``: what devices
without vLLM's fused EAGLE step kernel run, Ascend among them) against that kernel
(``eagle_step_update_slot_mapping_and_metadata``, which CUDA and CPU engines run):
positions, sequence lengths and slots at every depth, near ``max_model_len`` included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_chain_step_matches_vllms_fused_step_kernel(seed):
    from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed

    if not register_cpu_reference_ops_if_needed():
        pytest.skip("the kernel runs through vllm-specx's CPU ops only on a CPU host")
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode.utils import eagle_step_update_slot_mapping_and_metadata

    from vllm_specx.glue.draft_passes import PADDING_SLOT_ID, LookaheadPasses

    current_platform.register_triton_kernel_overrides()  # as each vLLM worker does

    g = torch.Generator().manual_seed(seed)
    n, block_size, max_len, blocks = 7, 16, 100, 8
    positions = torch.randint(0, max_len - 1, (n,), generator=g)
    positions[0], positions[1] = max_len - 2, max_len - 1  # steps run past the end
    base_seq = positions + 1
    block_table = torch.randperm(64, generator=g)[: n * blocks].view(n, blocks).to(torch.int32)
    fake = SimpleNamespace(positions_dev=positions, base_seq_dev=base_seq,
                           max_model_len=max_len, block_size=block_size,
                           cad=SimpleNamespace(seq_lens=base_seq.to(torch.int32)))
    pos_k, seq_k = positions.clone(), base_seq.to(torch.int32).clone()
    for depth in (1, 2, 3):
        want_pos = torch.empty(n, dtype=torch.int64)
        want_slots = torch.empty(n, dtype=torch.int64)
        eagle_step_update_slot_mapping_and_metadata(
            pos_k, block_table, seq_k, block_size, max_len, want_pos, want_slots)
        pos, seq, slots = LookaheadPasses._chain_step(fake, None, block_table, depth)
        # Past max_model_len both write nothing (padded slot); the position and sequence
        # length of such a row are don't-cares (its draft is cut): vLLM's kernel gives 0
        # and 1, the torch ops max_model_len - 1 and max_model_len.
        inside = positions + depth < max_len
        assert torch.equal(pos[inside], want_pos[inside]), depth
        assert (slots[~inside] == PADDING_SLOT_ID).all() and (~inside).any()
        assert torch.equal(seq[inside].to(torch.int64), seq_k[inside].to(torch.int64)), depth
        assert torch.equal(slots, want_slots), depth
        # The kernel's next step starts from its own output, as the drafter's buffers do.
        pos_k = want_pos.clone()
        pos_k[~inside] = positions[~inside] + depth  # vLLM's drafter keeps counting up
