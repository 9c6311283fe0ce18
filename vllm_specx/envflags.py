"""The one parser for on/off environment variables read by vllm-specx.

Every flag the plugin reads (``VLLM_SPECX_SKIP_VERSION_CHECK``,
``VLLM_SPECX_CPU_OPS_ALLOW_DRIFT``, and the foreign ``VLLM_USE_V2_MODEL_RUNNER`` and
``TRITON_INTERPRET`` it must agree with) goes through :func:`env_flag`, so they all
accept the same spellings. A value that is none of them is refused with one line naming
the variable, the value and what is allowed, rather than silently read as "off": a typo
in a bypass switch would otherwise look like the bypass not working.
"""

from __future__ import annotations

import os

TRUE_VALUES: tuple[str, ...] = ("1", "true", "yes", "on")
FALSE_VALUES: tuple[str, ...] = ("", "0", "false", "no", "off")


class EnvFlagError(ValueError):
    """An on/off environment variable holds a value that is neither on nor off."""


def parse_flag(name: str, value: str | None) -> bool:
    """``value`` of the variable ``name`` as a bool (``None``: unset, i.e. off)."""
    if value is None:
        return False
    normalised = value.strip().lower()
    if normalised in TRUE_VALUES:
        return True
    if normalised in FALSE_VALUES:
        return False
    raise EnvFlagError(
        f"environment variable {name}={value!r} is not an on/off value; use one of "
        f"{', '.join(TRUE_VALUES)} (on) or {', '.join(v for v in FALSE_VALUES if v)} "
        "or empty (off)."
    )


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is switched on (unset: off)."""
    return parse_flag(name, os.environ.get(name))
