"""``vllm-specx bench``: the benchmark that turns real vLLM engine runs into comparable numbers.

* :mod:`.cli` -- the ``bench`` sub-command (argument checks before any engine starts);
* :mod:`.configs` -- the speculative configurations compared (parsing, defaults, names);
* :mod:`.prompts` -- the prompt set (the fixtures' held-out prompts, or a JSONL file);
* :mod:`.core` -- the whole benchmark (baseline, standalone draft costs, configurations);
* :mod:`.engine_run` -- one engine run per configuration, recording each engine step
  (engines are started by :mod:`vllm_specx.engine`);
* :mod:`.metrics` -- pure arithmetic from per-request traces to every reported key
  (verification and discard rates, block efficiency, acceptance, padding, perplexity,
  SpecDec++ projected speed-up);
* :mod:`.energy` -- GPU energy through NVML, when there is one;
* :mod:`.report` -- markdown table and PNG plots from a report dict.

Importing this package imports neither vLLM nor torch.
"""
