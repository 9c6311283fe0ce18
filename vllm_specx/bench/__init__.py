"""``vllm-specx bench``: the benchmark that turns real vLLM engine runs into comparable numbers.

* :mod:`.metrics` -- pure arithmetic from per-request traces to every reported key
  (verification and discard rates, block efficiency, acceptance, padding, perplexity,
  SpecDec++ projected speed-up);
* :mod:`.runner` -- one engine run per configuration, recording each engine step;
* :mod:`.core` -- the whole benchmark (baseline, standalone draft costs, configurations);
* :mod:`.report` -- markdown table and PNG plots from a report dict;
* :mod:`.cli` -- the ``bench`` sub-command.

Importing this package imports neither vLLM nor torch.
"""
