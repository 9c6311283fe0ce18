"""vllm-specx: new speculative-decoding methods for vLLM.

Importing this package is cheap and imports neither vLLM nor a device runtime;
vLLM loads the plugin through the ``vllm.general_plugins`` entry point
(``vllm_specx.plugin:register``).
"""

__version__ = "0.1.0"
