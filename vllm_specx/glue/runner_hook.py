"""Runner hook: swap in the specx drafter and sampler on a freshly built V1 runner.

Called by the ``runner_specx_components`` patch right after ``GPUModelRunner.__init__``
(CPU runners run it too), i.e. after vLLM built its own drafter for the base method and
before ``load_model``, so the specx drafter loads its weights the normal way.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from vllm_specx.config import SpecxConfigError
from vllm_specx.methods import METHODS

logger = logging.getLogger("vllm.specx")  # under vLLM's logger: same handlers and format

# specx method -> "module:Class" of its proposer (constructed like vLLM's proposers:
# ``Class(vllm_config, device, runner)``). A method ships when it is listed here and
# marked available in vllm_specx.methods.
PROPOSERS: dict[str, str] = {
    "mtad": "vllm_specx.glue.mtad_proposer:MTADProposer",
}


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def install_specx_components(runner: Any, settings: dict[str, Any]) -> None:
    """Replace ``runner.drafter`` and ``runner.rejection_sampler`` for a specx method."""
    from vllm_specx.backends import select_backend
    from vllm_specx.glue.sampler import SpecxRejectionSampler

    method = settings["method"]
    spec = METHODS.get(method)
    if spec is None or not spec.available or method not in PROPOSERS:
        raise SpecxConfigError(
            f'speculative_config["method"] = "{method}" is not available yet in this version '
            "of vllm-specx."
        )
    backend = select_backend()
    runner.drafter = _load(PROPOSERS[method])(runner.vllm_config, runner.device, runner)
    runner.rejection_sampler = SpecxRejectionSampler(
        runner.sampler, runner.speculative_config, runner.device, settings, backend
    )
    logger.info("vllm-specx: %s drafter %s, sampler rule %r on the %s backend (%s)",
                method, type(runner.drafter).__name__, runner.rejection_sampler.rule,
                backend.name, backend.kernel_impl)
