"""vllm-specx: new speculative-decoding methods for vLLM, as a plugin.

Where things are:

* :mod:`.methods` -- the methods and their knobs (the user interface);
  :mod:`.config` validates a user's ``speculative_config`` and translates it for vLLM;
* :mod:`.algorithms` -- the algorithms, pure PyTorch (no vLLM import);
* :mod:`.backends` -- the per-device verification kernels, chosen in one place;
* :mod:`.glue` -- everything that touches vLLM (patches, runner hook, drafters, sampler;
  every touch-point is listed in :mod:`.glue.touchpoints`);
* :mod:`.plugin` -- the ``vllm.general_plugins`` entry point; :mod:`.version_gate`
  refuses a vLLM outside the supported range;
* :mod:`.cpu_ops` -- vLLM's compiled CPU ops in PyTorch, so the PyPI wheel's CPU engine
  runs;
* :mod:`.engine` -- engine start-up with CPU-friendly defaults;
* :mod:`.cli` -- the ``vllm-specx`` command (``methods``, ``bench``, ``train-head``);
  :mod:`.bench` and :mod:`.training` behind it;
* :mod:`.fixtures` -- the small trained target/draft pair of tests and benchmarks;
  :mod:`.envflags` -- the one parser of on/off environment variables;
* :mod:`.testing` -- helpers only tests use.

Importing this package is cheap and imports neither vLLM nor a device runtime; vLLM
loads the plugin through the ``vllm.general_plugins`` entry point
(``vllm_specx.plugin:register``).
"""

__version__ = "0.1.0"
