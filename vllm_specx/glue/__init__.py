"""vLLM glue: every place vllm-specx touches vLLM (the rest of the package does not).

* :mod:`.touchpoints` -- the manifest of every patch and private vLLM name, and the
  upgrade checklist;
* :mod:`.patch_base` -- :class:`~.patch_base.VllmPatch` and the post-import hook;
  :mod:`.patches` -- the plugin's seams (config translation, CLI choices, V1 runner
  selection, runner hook);
* :mod:`.runner_hook` -- swaps the specx drafter and sampler into a new V1 runner;
* :mod:`.draft_passes` -- draft forward passes shared by the specx drafters;
  :mod:`.mtad_proposer`, :mod:`.adaptive_proposer` -- the drafters;
* :mod:`.sampler` -- the specx rejection sampler (vLLM's contract, our verification).
"""
