"""Per-request stop rules for adaptive-length chain drafting (SpecDec++: Huang et al. 2024).

The drafter drafts chains ``Y_1, Y_2, ...`` for a batch of live requests. At depth ``j``
(``j = 0, 1, ...``; every live row of one call has the same depth, because requests that
stop leave the batch) the draft has just drawn the candidate ``Y_{j+1}`` from its warped
distribution ``q_{j+1}``, which it got by feeding ``Y_j`` (by the round's first pass when
``j = 0``); feeding ``Y_j`` also gave its final hidden state ``h_j`` (after the final norm:
the tensor its LM head reads). ``Y_{j+1}`` joins the draft in any case: it is already
drawn, costs no further draft forward, and may be accepted. A rule answers, per row,
whether the drafter goes on (``keep``: feed ``Y_{j+1}`` and draw ``Y_{j+2}``) or the round
stops with ``j + 1`` tokens. A stop therefore never pays the draft forward that SpecDec++'s
"stop before ``Y_{j+1}``" pays: that forward already happened when ``Y_{j+1}`` was drawn.

Every rule is clamped to ``[min_tokens, max_tokens]`` (``min_speculative_tokens`` and
``K_max``) on the number of drafted tokens ``j + 1``: ``keep`` is True while
``j + 1 < min_tokens`` and False once ``j + 1 >= max_tokens``, whatever the rule says.
State still advances on forced steps, so a rule's running product covers every drafted
token.

Rules:

* :class:`AlwaysContinue`: never stops early (fixed K = ``max_tokens``).
* :class:`ConfidenceStop`: training-free; go on after ``Y_{j+1}`` iff the draft's own
  confidence in it is at least ``threshold`` (the round ends with its first low-confidence
  token). Signals: ``token_prob`` = ``q_{j+1}(Y_{j+1})``, ``max_prob`` =
  ``max q_{j+1}``, ``top2_margin`` = top-1 minus top-2 probability of ``q_{j+1}``.
* :class:`HeadStop`: SpecDec++. ``P_j = head(h_j)`` is the predicted acceptance probability
  of ``Y_j``; ``P_all = prod_{i<=j} P_i``; keep iff not ``1 - P_all > h``: stop once the
  predicted probability that some token so far is rejected exceeds ``h`` (``Y_{j+1}``, already
  drawn, is kept).

Pure PyTorch, no vLLM import. The state is a plain ``[R]`` float32 tensor so the caller can
slice it with its live-row mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from vllm_specx.algorithms import stop_defaults
from vllm_specx.algorithms.stop_defaults import CONFIDENCE_SIGNALS

DEFAULT_CONFIDENCE_SIGNAL = stop_defaults.CONFIDENCE_SIGNAL


@runtime_checkable
class DraftStopRule(Protocol):
    """What the adaptive drafter calls after each draft step (see the module doc)."""

    needs_hidden: bool  # True: ``step`` must get ``hidden`` (h_j)
    needs_probs: bool  # True: ``step`` must get ``next_probs`` (the full q_{j+1})
    min_tokens: int
    max_tokens: int

    def start(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """Per-row state at the start of a round (before ``Y_1``)."""
        ...

    def step(
        self,
        state: torch.Tensor,
        depth: int,
        *,
        next_token_probs: torch.Tensor,
        next_probs: torch.Tensor | None,
        hidden: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(new_state [R], keep [R] bool)``: whether the drafter goes on after
        ``Y_{depth+1}`` (which has joined the draft) or stops with ``depth + 1`` tokens."""
        ...


def _check_bounds(min_tokens: int, max_tokens: int) -> None:
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(
            f"min_tokens={min_tokens}, max_tokens={max_tokens}: need 1 <= min_tokens <= "
            "max_tokens (min_speculative_tokens <= num_speculative_tokens)"
        )


def clamp_keep(keep: torch.Tensor, depth: int, min_tokens: int, max_tokens: int) -> torch.Tensor:
    """At depth ``j`` the round holds ``j + 1`` tokens: force ``keep`` True while that is
    under ``min_tokens`` and False once it reaches ``max_tokens``."""
    drafted = depth + 1
    if drafted >= max_tokens:
        return torch.zeros_like(keep, dtype=torch.bool)
    if drafted < min_tokens:
        return torch.ones_like(keep, dtype=torch.bool)
    return keep.to(torch.bool)


class AlwaysContinue:
    """Fixed K: every request drafts ``max_tokens`` tokens (``min_tokens`` is irrelevant)."""

    needs_hidden = False
    needs_probs = False

    def __init__(self, max_tokens: int, min_tokens: int = 1) -> None:
        _check_bounds(min_tokens, max_tokens)
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens

    def start(self, num_rows: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_rows, dtype=torch.float32, device=device)

    def step(
        self,
        state: torch.Tensor,
        depth: int,
        *,
        next_token_probs: torch.Tensor,
        next_probs: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keep = torch.ones(state.shape[0], dtype=torch.bool, device=state.device)
        return state, clamp_keep(keep, depth, self.min_tokens, self.max_tokens)


def confidence_signal(
    signal: str, next_token_probs: torch.Tensor, next_probs: torch.Tensor | None
) -> torch.Tensor:
    """The draft's confidence in ``Y_{j+1}`` as a float32 ``[R]`` tensor (see module doc)."""
    if signal == "token_prob":
        return next_token_probs.float()
    if next_probs is None:
        raise ValueError(f"confidence signal {signal!r} needs next_probs (the full q_{{j+1}})")
    if signal == "max_prob":
        return next_probs.float().amax(dim=-1)
    if signal == "top2_margin":
        if next_probs.shape[-1] < 2:
            return next_probs.float()[..., 0]
        top2 = next_probs.float().topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    raise ValueError(
        f"confidence_signal={signal!r} is not allowed; allowed: {', '.join(CONFIDENCE_SIGNALS)}"
    )


class ConfidenceStop:
    """Training-free: keep ``Y_{j+1}`` iff the draft's confidence in it is >= ``threshold``."""

    needs_hidden = False

    def __init__(
        self,
        threshold: float,
        signal: str = DEFAULT_CONFIDENCE_SIGNAL,
        *,
        min_tokens: int = 1,
        max_tokens: int,
    ) -> None:
        if signal not in CONFIDENCE_SIGNALS:
            raise ValueError(
                f"confidence_signal={signal!r} is not allowed; allowed: "
                f"{', '.join(CONFIDENCE_SIGNALS)}"
            )
        _check_bounds(min_tokens, max_tokens)
        self.threshold = float(threshold)
        self.signal = signal
        self.needs_probs = signal != "token_prob"
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens

    def start(self, num_rows: int, device: torch.device) -> torch.Tensor:
        # Stateless: a zero per row keeps the caller's slicing uniform across rules.
        return torch.zeros(num_rows, dtype=torch.float32, device=device)

    def step(
        self,
        state: torch.Tensor,
        depth: int,
        *,
        next_token_probs: torch.Tensor,
        next_probs: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        conf = confidence_signal(self.signal, next_token_probs, next_probs)
        keep = conf >= self.threshold
        return state, clamp_keep(keep, depth, self.min_tokens, self.max_tokens)


class HeadStop:
    """SpecDec++: ``P_all *= head(h_j)``; keep iff not ``1 - P_all > stop_threshold``.

    At ``depth == 0`` the hidden state belongs to the last verified token, not to a draft, so
    nothing is multiplied (SpecDec++ treats that step's acceptance as 1).
    """

    needs_hidden = True
    needs_probs = False

    def __init__(
        self,
        head: torch.nn.Module,
        stop_threshold: float,
        *,
        min_tokens: int = 1,
        max_tokens: int,
    ) -> None:
        _check_bounds(min_tokens, max_tokens)
        if not hasattr(head, "accept_prob"):
            raise TypeError("HeadStop needs an AcceptanceHead (a module with accept_prob())")
        self.head = head
        self.stop_threshold = float(stop_threshold)
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens

    def start(self, num_rows: int, device: torch.device) -> torch.Tensor:
        return torch.ones(num_rows, dtype=torch.float32, device=device)

    def step(
        self,
        state: torch.Tensor,
        depth: int,
        *,
        next_token_probs: torch.Tensor | None = None,
        next_probs: torch.Tensor | None = None,
        hidden: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if depth >= 1:
            if hidden is None:
                raise ValueError("HeadStop.step needs hidden (the draft's final hidden state h_j)")
            with torch.no_grad():
                state = state * self.head.accept_prob(hidden).float()
        keep = ~(1.0 - state > self.stop_threshold)
        return state, clamp_keep(keep, depth, self.min_tokens, self.max_tokens)


def make_stop_rule(
    settings: Mapping[str, Any],
    head: torch.nn.Module | None,
    confidence_signal: str = DEFAULT_CONFIDENCE_SIGNAL,
) -> DraftStopRule:
    """The stop rule for a specx settings dict (the ``adaptive`` method's knobs).

    ``num_speculative_tokens`` is K_max. With a loaded ``head`` the rule is :class:`HeadStop`
    (``stop_threshold``), without one :class:`ConfidenceStop` (``confidence_threshold`` and
    the ``confidence_signal`` setting, else the argument). A setting left out falls back
    to the rule's own default (:mod:`.stop_defaults`); a method with defaults of its own
    passes them in ``settings``. A settings dict that names an
    ``acceptance_head`` while ``head`` is None is refused: the caller loads the head
    (``load_head``) on its own device and dtype.
    """
    if "num_speculative_tokens" not in settings:
        raise ValueError("num_speculative_tokens is required (K_max of the adaptive draft)")
    max_tokens = int(settings["num_speculative_tokens"])
    min_tokens = settings.get("min_speculative_tokens")
    min_tokens = int(stop_defaults.MIN_TOKENS if min_tokens is None else min_tokens)
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(
            f"min_speculative_tokens={min_tokens} is not allowed; allowed: an integer >= 1 and "
            f"<= num_speculative_tokens ({max_tokens})"
        )
    if head is not None:
        h = settings.get("stop_threshold")
        h = float(stop_defaults.STOP_THRESHOLD if h is None else h)
        return HeadStop(head, h, min_tokens=min_tokens, max_tokens=max_tokens)
    if settings.get("acceptance_head"):
        raise ValueError(
            f"acceptance_head={settings['acceptance_head']!r} is set but no head was passed: "
            "load it with vllm_specx.algorithms.acceptance_head.load_head first"
        )
    threshold = settings.get("confidence_threshold")
    threshold = float(stop_defaults.CONFIDENCE_THRESHOLD if threshold is None else threshold)
    # A "confidence_signal" setting (if the method grows that knob) wins over the argument.
    signal = settings.get("confidence_signal") or confidence_signal
    return ConfidenceStop(threshold, signal, min_tokens=min_tokens, max_tokens=max_tokens)


def fixed_keep(rule: DraftStopRule, depth: int) -> bool | None:
    """``keep`` at ``depth`` when it is the same for every row whatever the draft says
    (a fixed K, or the ``[min_tokens, max_tokens]`` clamp of the rules above), else None:
    the rule decides row by row. A caller that gets a bool needs no per-row answer, so a
    drafting round can go on without reading the rule's verdict back from the device.
    Rules of other types (defined elsewhere) are asked every time (None)."""
    drafted = depth + 1
    if isinstance(rule, AlwaysContinue):
        return drafted < rule.max_tokens
    if type(rule) in (ConfidenceStop, HeadStop):
        if drafted >= rule.max_tokens:
            return False
        if drafted < rule.min_tokens:
            return True
    return None


def step_needed(rule: DraftStopRule, depth: int) -> bool:
    """Whether ``rule.step`` must run at ``depth``: its verdict there is per row, or its
    state must advance for a per-row verdict later in the round (:class:`HeadStop`'s
    running product). False lets a round skip the step, and the probabilities it reads."""
    if fixed_keep(rule, depth) is None:
        return True
    if isinstance(rule, (AlwaysContinue, ConfidenceStop)):  # stateless
        return False
    if isinstance(rule, HeadStop):
        return any(fixed_keep(rule, d) is None for d in range(depth + 1, rule.max_tokens))
    return True
