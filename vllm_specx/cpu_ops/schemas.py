"""The drift table: for each supported vLLM release, the ``_C`` ops we implement.

Why a table keyed by the exact vLLM release: the reference ops stand in for C++ code
that vLLM compiles from its own source tree, so their schemas (argument lists) and
meaning belong to one vLLM release. A schema that silently changed under us would
make an op compute the wrong thing instead of failing, so registration refuses any
vLLM release that is not listed here (see :mod:`vllm_specx.cpu_ops.drift`).

How to add a release (see docs/cpu-reference-backend.md): copy the newest entry, diff
vLLM's ``csrc/cpu/torch_bindings.cpp`` between the two releases for every op listed
here, update the schema strings, re-read the Python call sites, run
``tests/cpu_ops`` and ``tests/engine``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReleaseTable:
    """What one vLLM release asks of the CPU ``_C`` namespace."""

    # op name -> schema string exactly as vLLM's CPU build declares it (no namespace)
    ops: dict[str, str]
    # ``torch.ops._C.<name>`` references on vLLM's CPU code paths that we knowingly
    # leave unimplemented, with the reason. vLLM probes each of these with hasattr()
    # and has a fallback, or it is unreachable for the models we support.
    known_unimplemented: dict[str, str] = field(default_factory=dict)
    # Triton kernels whose CPU adapter in ``vllm/utils/cpu_triton_utils.py`` is
    # defective in this release, mapped to the kernel's expected parameter names;
    # we replace those adapters (docs/upstream-vllm-cpu-adapter-defects.md).
    defective_adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Runtime fixes of vLLM's kernel-override machinery to apply for this release
    # (names of :data:`vllm_specx.cpu_ops.vllm_fixes.FIXES`).
    runtime_fixes: tuple[str, ...] = ()
    # Faster stand-ins for vLLM's CPU GEMM choice to apply for this release (names of
    # :data:`vllm_specx.cpu_ops.linear.PATCHES`).
    linear_patches: tuple[str, ...] = ()


_OPS_0_32_0: dict[str, str] = {
    # --- worker / platform ---------------------------------------------------------
    "init_cpu_memory_env": "init_cpu_memory_env(SymInt[] node_ids) -> ()",
    "cpu_attn_has_isa": "cpu_attn_has_isa(str isa) -> bool",
    # --- positional encoding ---------------------------------------------------------
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, "
        "bool inverse=False) -> ()"
    ),
    # --- paged attention -------------------------------------------------------------
    "get_scheduler_metadata": (
        "get_scheduler_metadata(int num_req, int num_heads_q, int num_heads_kv, "
        "int head_dim, Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, "
        "bool casual, int window_size, str isa_hint, bool enable_kv_split, "
        'Tensor? dynamic_causal, str kv_cache_dtype="auto") -> Tensor'
    ),
    "cpu_attn_reshape_and_cache": (
        "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) key_cache, "
        "Tensor(a3!) value_cache, Tensor slot_mapping, str isa, float k_scale=1.0, "
        'float v_scale=1.0, str kv_cache_dtype="auto") -> ()'
    ),
    "cpu_attention_with_kv_cache": (
        "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor(a3!) output, Tensor query_start_loc, Tensor seq_lens, float scale, "
        "bool causal, Tensor? alibi_slopes, SymInt sliding_window_size, "
        "Tensor block_table, float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
        "Tensor? dynamic_causal, float k_scale=1.0, float v_scale=1.0, "
        'str kv_cache_dtype="auto") -> ()'
    ),
    "compute_slot_mapping_kernel_impl": (
        "compute_slot_mapping_kernel_impl(Tensor query_start_loc, Tensor positions, "
        "Tensor block_table, Tensor(a3!) slot_mapping, SymInt block_size) -> ()"
    ),
    # --- sampling --------------------------------------------------------------------
    "greedy_argmax": "greedy_argmax(Tensor logits) -> Tensor",
    "fused_gumbel_argmax": "fused_gumbel_argmax(Tensor logits, Tensor seeds) -> Tensor",
    # --- speculative decoding ----------------------------------------------------------
    "rejection_greedy_sample_kernel_impl": (
        "rejection_greedy_sample_kernel_impl(Tensor(a0!) output_token_ids, "
        "Tensor cu_num_draft_tokens, Tensor draft_token_ids, Tensor target_argmax, "
        "Tensor bonus_token_ids, Tensor? is_greedy, SymInt max_spec_len) -> ()"
    ),
    "rejection_random_sample_kernel_impl": (
        "rejection_random_sample_kernel_impl(Tensor(a0!) output_token_ids, "
        "Tensor cu_num_draft_tokens, Tensor draft_token_ids, Tensor? draft_probs, "
        "Tensor target_probs, Tensor bonus_token_ids, Tensor recovered_token_ids, "
        "Tensor uniform_probs, Tensor? is_greedy, SymInt max_spec_len, "
        "SymInt vocab_size, bool no_draft_probs) -> ()"
    ),
    "expand_kernel_impl": (
        "expand_kernel_impl(Tensor(a0!) output, Tensor input, Tensor cu_num_tokens, "
        "SymInt replace_from, SymInt replace_to) -> ()"
    ),
    "sample_recovered_tokens_kernel_impl": (
        "sample_recovered_tokens_kernel_impl(Tensor(a0!) output_token_ids, "
        "Tensor cu_num_draft_tokens, Tensor draft_token_ids, Tensor? draft_probs, "
        "Tensor target_probs, Tensor inv_q, SymInt vocab_size, "
        "bool no_draft_probs) -> ()"
    ),
    "eagle_prepare_inputs_padded_kernel_impl": (
        "eagle_prepare_inputs_padded_kernel_impl(Tensor cu_num_draft_tokens, "
        "Tensor valid_sampled_tokens_count, Tensor query_start_loc_gpu, "
        "Tensor(a3!) token_indices_to_sample, Tensor(a4!) num_rejected_tokens_gpu, "
        "SymInt num_reqs) -> ()"
    ),
    "eagle_prepare_next_token_padded_kernel_impl": (
        "eagle_prepare_next_token_padded_kernel_impl(Tensor sampled_token_ids, "
        "Tensor discard_request_mask, Tensor backup_next_token_ids, "
        "Tensor(a3!) next_token_ids, Tensor(a4!) valid_sampled_tokens_count, "
        "SymInt vocab_size, SymInt num_sampled_tokens_per_req, SymInt num_reqs) -> ()"
    ),
    "eagle_step_slot_mapping_metadata_kernel_impl": (
        "eagle_step_slot_mapping_metadata_kernel_impl(Tensor positions, "
        "Tensor block_table, Tensor(a2!) seq_lens, Tensor(a3!) out_clamped_positions, "
        "Tensor(a4!) out_slot_mapping, SymInt block_size, SymInt max_model_len, "
        "SymInt PAD_ID) -> ()"
    ),
    "copy_and_expand_eagle_inputs_kernel_impl": (
        "copy_and_expand_eagle_inputs_kernel_impl(Tensor target_token_ids, "
        "Tensor target_positions, Tensor next_token_ids, Tensor(a3!) out_input_ids, "
        "Tensor(a4!) out_positions, Tensor(a5!) out_is_rejected_token_mask, "
        "Tensor(a6!) out_is_masked_token_mask, Tensor(a7!) out_new_token_indices, "
        "Tensor(a8!) out_hidden_state_mapping, Tensor query_start_loc, "
        "Tensor query_end_loc, SymInt padding_token_id, "
        "SymInt parallel_drafting_token_id, SymInt total_input_tokens, "
        "SymInt num_padding_slots_per_request, bool shift_input_ids) -> ()"
    ),
    # --- MLA (DeepSeek) ----------------------------------------------------------------
    # The CPU_MLA backend's decode step (vllm/_custom_ops.py::mla_decode_kvcache_cpu);
    # schema as csrc/cpu/torch_bindings.cpp declares it.
    "mla_decode_kvcache": (
        "mla_decode_kvcache(Tensor(a0!) out, Tensor query, Tensor kv_cache, float scale, "
        "Tensor block_tables, Tensor seq_lens) -> ()"
    ),
}

_RELEASE_0_32_0 = ReleaseTable(
    ops=_OPS_0_32_0,
    known_unimplemented={
        "copy_and_expand_dflash_inputs_kernel_impl": (
            "DFlash drafting only; vLLM probes it with hasattr() and falls back to "
            "a Python loop"
        ),
    },
    defective_adapters={
        # kernel qualified name -> the Triton kernel's parameter names, which our
        # replacement adopts so the dispatcher forwards launch arguments by name
        "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": (
            "num_tokens",
            "max_num_tokens",
            "query_start_loc_ptr",
            "positions_ptr",
            "block_table_ptr",
            "block_table_stride",
            "slot_mapping_ptr",
            "KV_CACHE_BLOCK_SIZE",
            "TOTAL_CP_WORLD_SIZE",
            "TOTAL_CP_RANK",
            "CP_KV_CACHE_INTERLEAVE_SIZE",
            "PAD_ID",
            "BLOCK_SIZE",
        ),
        "vllm.v1.sample.rejection_sampler.expand_kernel": (
            "output_ptr",
            "input_ptr",
            "cu_num_tokens_ptr",
            "replace_from",
            "replace_to",
            "MAX_NUM_TOKENS",
        ),
    },
    runtime_fixes=(
        "tolerant_kernel_rebind", "register_overrides_once",
        "seeded_partial_prefill", "top_k_only_empty_batch",
        "v2_top_k_top_p_sampler", "v2_top_k_top_p_states",
        # Defect 6 (AMX_MLA on AMX hosts): read in the 0.32.0 wheel only.
        "reference_mla_on_amx_hosts",
    ),
    # dispatch_cpu_unquantized_gemm and its two callers (linear.py,
    # vocab_parallel_embedding.py) read identical in the 0.33.0 wheel.
    linear_patches=("cpu_onednn_packed_linear",),
)

RELEASES: dict[str, ReleaseTable] = {
    "0.32.0": _RELEASE_0_32_0,
    # 0.33.0 (checked 2026-11 against the 0.33.0 sdist): csrc/cpu/torch_bindings.cpp
    # declares all 17 ops above with identical schemas; the Python call sites on the CPU
    # path call the same ops in the same way (drift scan clean); the Triton kernels of
    # both defective adapters kept their parameter lists. Upstream fixed the argument
    # shift of the slot-mapping adapter, but its adapter still neither pads
    # slot_mapping[num_tokens:max_num_tokens] with PAD_ID nor handles context
    # parallelism as the kernel does, so ours stays; the expand adapter still writes
    # int64 copies. The attention kernel's internal work-item layout changed, which the
    # reference ops do not share (get_scheduler_metadata's tensor is opaque to vLLM).
    # mla_decode_kvcache was added to the table later (2026-11-22) and checked against
    # 0.32.0 only; the call-site scan still checks its 0.33.0 call when run there.
    "0.33.0": _RELEASE_0_32_0,
}


# vLLM source files (relative to the vllm package) whose ``torch.ops._C.<name>`` calls
# make up "what the CPU engine asks for". Every op referenced in them must be either
# implemented (``ops``) or listed in ``known_unimplemented``. ``_custom_ops.py`` is not
# in this list because it wraps every device's ops; only the call sites of the ops we
# implement are checked there (their argument counts against our schemas).
CPU_PATH_SOURCES: tuple[str, ...] = (
    "v1/attention/backends/cpu_attn.py",
    "v1/worker/cpu_worker.py",
    "v1/worker/cpu_model_runner.py",
    "v1/sample/sampler.py",
    "v1/sample/ops/topk_topp_sampler.py",
    "utils/cpu_triton_utils.py",
)
CALL_SITE_SOURCES: tuple[str, ...] = ("_custom_ops.py", *CPU_PATH_SOURCES)


def supported_releases() -> list[str]:
    """The vLLM releases in the drift table, oldest first."""
    from packaging.version import Version

    return sorted(RELEASES, key=Version)
