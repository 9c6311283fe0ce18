"""Training tools shared by the ``vllm-specx`` commands that train small models.

* :mod:`vllm_specx.training.data`: prompt files (plain text or stdlib references) and
  response generation by the target in the real vLLM engine, at given temperatures.
* :mod:`vllm_specx.training.loop`: a small seeded training loop (progress bar, cosine
  schedule) and binary metrics (soft AUC).
* :mod:`vllm_specx.training.head`: SpecDec++ acceptance-head data (teacher-forced labels,
  token mixing), its loss and ``train-head``.
* :mod:`vllm_specx.training.cli`: the ``vllm-specx train-head`` command line.

Importing this package is cheap; torch, transformers and vLLM load inside the functions.
"""
