"""Runner hook: swap in the specx drafter and sampler on a freshly built V1 runner.

Called by the ``runner_specx_components`` patch right after ``GPUModelRunner.__init__``
(CPU runners run it too), i.e. after vLLM built its own drafter for the base method and
before ``load_model``, so the specx drafter loads its weights the normal way.

Everything method-specific comes from the method's :class:`~vllm_specx.methods.MethodSpec`
(its proposer factory and verification rule); this hook only plumbs.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_specx.config import SpecxConfigError
from vllm_specx.glue.proposer_contract import SpecxProposer
from vllm_specx.methods import METHODS, draft_model_tree, tree_on

logger = logging.getLogger("vllm.specx")  # under vLLM's logger: same handlers and format


def install_specx_components(runner: Any, settings: dict[str, Any]) -> None:
    """Replace ``runner.drafter`` and ``runner.rejection_sampler`` for a specx method.

    ``settings`` are the validated specx settings (``additional_config["specx"]``,
    defaults filled in by config validation). The proposer receives them as its
    ``settings`` attribute, set here right after construction and before ``load_model``;
    it never reads the config or applies defaults itself.
    """
    from vllm_specx.backends import select_backend
    from vllm_specx.glue.sampler import SpecxRejectionSampler

    method = settings["method"]
    spec = METHODS.get(method)
    if spec is None or not spec.available or spec.proposer is None:
        raise SpecxConfigError(
            f'speculative_config["method"] = "{method}" is not available yet in this version '
            "of vllm-specx."
        )
    backend = select_backend()
    drafter_settings = dict(settings)
    proposer = spec.proposer()
    if draft_model_tree(settings) is not None:
        # adaptive with draft_tree: the tree is drafted by the MTAD round's beam passes.
        from vllm_specx.glue.mtad_proposer import DraftTreeProposer, tree_drafter_settings

        proposer, drafter_settings = DraftTreeProposer, tree_drafter_settings(settings)
    drafter = proposer(runner.vllm_config, runner.device, runner)
    drafter.settings = drafter_settings
    if not isinstance(drafter, SpecxProposer):
        raise TypeError(
            f"vllm-specx: {method}'s proposer {type(drafter).__name__} does not offer the "
            "specx proposer contract (glue/proposer_contract.py: settings, propose, "
            "take_last_draft_probs, specx_stats)"
        )
    runner.drafter = drafter
    runner.rejection_sampler = SpecxRejectionSampler(
        runner.sampler, runner.speculative_config, runner.device, settings, backend
    )
    if tree_on(settings):
        _install_tree_state(runner, settings)
    logger.info("vllm-specx: %s on Model Runner V1: drafter %s, sampler rule %r on the %s "
                "backend (%s)", method, type(runner.drafter).__name__,
                runner.rejection_sampler.rule, backend.name, backend.kernel_impl)


def _install_tree_state(runner: Any, settings: dict[str, Any]) -> None:
    """Draft trees (glue/tree_step.py): one shared state for the drafter, the sampler and
    the runner's tree-step patches."""
    state = new_tree_state(runner, settings)
    runner.drafter.tree_state = state
    runner.rejection_sampler.tree_state = state


def new_tree_state(runner: Any, settings: dict[str, Any]) -> Any:
    """The runner's :class:`~vllm_specx.glue.tree_step.TreeState` (``runner.specx_tree_state``,
    read by the tree-step patches of V1 and V2), after the checks config validation
    cannot make: it refused Ascend and put a CUDA target on TRITON_ATTN, eager (either
    runner); this refuses a CPU engine whose attention is not vllm-specx's (vLLM's
    compiled CPU build takes no ancestor mask, so a tree would be attended causally:
    wrong outputs), a CUDA engine on another attention backend (the tree kernel is routed
    through TRITON_ATTN only) or with CUDA graphs (a replayed graph would attend the tree
    causally: the route to the tree kernel is decided in Python at each forward), and a
    sliding-window target."""
    from vllm_specx.cpu_ops import registered_release
    from vllm_specx.glue.tree_step import TreeState

    device = getattr(runner.device, "type", str(runner.device))
    where = None
    if device == "cpu":
        if registered_release() is None:
            where = "vLLM's compiled CPU attention (no ancestor mask)"
    elif device == "cuda":
        backend = getattr(runner.vllm_config.attention_config.backend, "name", None)
        if backend != "TRITON_ATTN":
            where = f"CUDA with the {backend or 'default'} attention backend"
        else:
            mode = runner.vllm_config.compilation_config.cudagraph_mode
            if getattr(mode, "name", "NONE") != "NONE":
                where = f"CUDA with CUDA graphs (cudagraph_mode {mode.name})"
    else:
        where = f"the {device} device"
    if where is not None:
        raise SpecxConfigError(
            f'speculative_config["draft_tree"] = {settings.get("draft_tree")!r} is not '
            f"allowed for method '{settings['method']}' on {where}: tree verification runs "
            "on CPU with vllm-specx's CPU attention or on CUDA with vLLM's TRITON_ATTN "
            "backend, eager (V1 or V2 model runner)."
        )
    window = runner.model_config.get_sliding_window()
    if window:
        # A node's RoPE position (ctx + depth) is not its KV slot (ctx + 1 + index): a
        # window counted over slots would cut the wrong keys.
        raise SpecxConfigError(
            f'speculative_config["draft_tree"] = {settings.get("draft_tree")!r} is not '
            f"allowed for method '{settings['method']}' with a sliding-window target "
            f"(window {window}): tree attention is implemented for full attention only."
        )
    state = TreeState()
    runner.specx_tree_state = state
    return state
