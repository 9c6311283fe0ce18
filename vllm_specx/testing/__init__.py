"""What only tests (and the test-like examples) use: tiny local models and a reference.

* :mod:`.tiny_models` -- small real Llama models and tokenizers built on the spot
  (target/draft pairs, a draft with another vocabulary); nothing is downloaded;
* :mod:`.hf_reference` -- Hugging Face transformers' greedy decoding, the reference
  that vLLM's outputs are compared with.

Starting an engine is product code: :mod:`vllm_specx.engine`.
"""
