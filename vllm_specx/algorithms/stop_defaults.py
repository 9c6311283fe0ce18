"""Default parameters of the draft stop rules (:mod:`.draft_stop`).

Pure Python (no torch), so the user-interface layer (``vllm_specx/methods.py``) takes
the ``adaptive`` method's knob defaults from here without importing torch, and the
rules fall back to the same numbers when a caller leaves a setting out. A method with a
default of its own (``specx_mtp``'s confidence threshold) says so in its knob; the glue
fills a round's settings from the method's knobs (``glue/draft_passes.round_stop_rule``).
"""

from __future__ import annotations

# Never stop a draft before this many tokens.
MIN_TOKENS = 1
# SpecDec++'s h: stop once the predicted probability that some draft token is rejected
# exceeds it.
STOP_THRESHOLD = 0.7
# Training-free rule: stop when the draft's own confidence falls under this.
CONFIDENCE_THRESHOLD = 0.5
# The confidences the training-free rule can read (see ``draft_stop.confidence_signal``).
CONFIDENCE_SIGNALS = ("token_prob", "max_prob", "top2_margin")
CONFIDENCE_SIGNAL = "token_prob"
