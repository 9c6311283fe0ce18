"""Device-independent algorithms of vllm-specx, in pure PyTorch (no vLLM import).

* :mod:`.verify` -- verification of drafts: standard (lossless) rejection sampling,
  one-hot and greedy variants, and MTAD's joint-likelihood rule;
* :mod:`.draft_tree` -- draft trees: their layout and attention mask, building them
  (static paths, per-depth candidates) and verifying them in one pass;
* :mod:`.beam_draft` -- MTAD's beam-search drafting; :mod:`.beam_tails` -- scheduling
  the beam tails into draft forward passes;
* :mod:`.draft_stop` -- per-request stop rules for adaptive-length drafting (SpecDec++);
  :mod:`.acceptance_head` -- SpecDec++'s acceptance-prediction head.
"""
