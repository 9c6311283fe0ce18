"""Validate a user's speculative-config dict and translate specx methods for vLLM.

A specx method (``mtad``, ``adaptive``, ``specx_mtp``) becomes a vLLM base config
(e.g. ``{"method": "draft_model", ...}``) plus the specx settings, which travel to
every worker in ``additional_config["specx"]``. vLLM's own methods pass through
untouched (the function returns ``None`` for them).

Every refusal is ONE ``SpecxConfigError`` line naming the key, the value and what is
allowed, raised before the engine starts. No vLLM import here: the caller passes
vLLM's method names and config fields, and the device limits.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# Re-exported: callers ask config validation whether a head fits.
from vllm_specx.acceptance_head_files import acceptance_head_problem, read_safetensors_shapes
from vllm_specx.methods import (
    COMMON_KNOBS,
    CONFLICTING_VLLM_KEYS,
    METHODS,
    PASSTHROUGH_VLLM_KEYS,
    VLLM_ALIASES,
    CheckContext,
    MethodSpec,
    knob_owners,
    tree_max_nodes,
)

if TYPE_CHECKING:  # validation needs the limits' values, not torch (backends import it)
    from vllm_specx.backends.base import DeviceLimits

SPECX_CONFIG_KEY = "specx"  # key under vLLM's additional_config

__all__ = [
    "SPECX_CONFIG_KEY", "SpecxConfigError", "Translation", "acceptance_head_problem",
    "read_safetensors_shapes", "refusal_error", "resolve_method", "specx_settings",
    "speculative_config_dict", "translate",
]


def specx_settings(vllm_config: Any) -> dict[str, Any] | None:
    """The specx settings a VllmConfig carries (``additional_config["specx"]``, written by
    :func:`translate`'s caller), or None when no specx method is on."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        return extra.get(SPECX_CONFIG_KEY)
    return None


class SpecxConfigError(ValueError):
    """A speculative-config value vllm-specx refuses, with the reason in one line."""


@dataclass(frozen=True)
class Translation:
    """What a specx speculative config becomes."""

    vllm_speculative_config: dict[str, Any]
    specx_settings: dict[str, Any]


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)


def _bad(key: str, value: Any, allowed: str, method: str | None = None) -> SpecxConfigError:
    where = f" for method '{method}'" if method else ""
    return SpecxConfigError(
        f'speculative_config["{key}"] = {_fmt(value)} is not allowed{where}: {allowed}.'
    )


# The same one-line refusal for checks that run later, where vLLM's config is known
# (glue/patches.py: the target's hidden size for a specx_mtp acceptance head).
refusal_error = _bad


_KIND_NAMES = {str: "a string", list: "a list", tuple: "a list", int: "a number",
               float: "a number", bool: "a boolean"}


def speculative_config_dict(value: Any) -> dict[str, Any]:
    """``value`` as a settings dict, or ONE line saying what was given and what is allowed.

    vLLM itself would fail deep inside the config seam with a raw ``ValueError`` or
    ``TypeError`` for a string, a list or a number (e.g. ``--speculative-config '[1,2]'``).
    """
    example = '{"method": "mtad", "model": "<draft model>"}'
    if not isinstance(value, Mapping):
        kind = _KIND_NAMES.get(type(value), type(value).__name__)
        raise SpecxConfigError(
            f"speculative_config = {_fmt(value)} is not allowed: it must be a JSON object "
            f"(a dict of settings) such as {example}, not {kind}."
        )
    for key in value:
        if not isinstance(key, str):
            raise SpecxConfigError(
                f"speculative_config key {_fmt(key)} is not allowed: keys are setting names "
                f"(strings), as in {example}."
            )
    return dict(value)


def resolve_method(config: Mapping[str, Any], vllm_methods: Collection[str]) -> str | None:
    """The specx method a config selects, or None when it is vLLM's own business.

    Raises for an unknown method name, and for specx knobs given to a vLLM method or
    with no method at all (they would otherwise be silently dropped or rejected by vLLM
    with a message that does not mention the plugin).
    """
    method = config.get("method")
    specx_keys = sorted(k for k in config if knob_owners(k))
    if method is None:
        if specx_keys:
            owners = knob_owners(specx_keys[0])
            raise _bad(
                specx_keys[0], config[specx_keys[0]],
                f"it is a knob of specx method {_or(owners)}; set \"method\" to use it",
            )
        return None
    if not isinstance(method, str) or method not in set(vllm_methods) | set(METHODS):
        raise _bad(
            "method", method,
            "valid methods are vllm-specx's " + ", ".join(sorted(METHODS))
            + " and vLLM's " + ", ".join(sorted(set(vllm_methods) - set(METHODS))),
        )
    if method in METHODS:
        return method
    alias = VLLM_ALIASES.get(method)
    if alias is not None and any(k in alias[1] for k in config):
        return alias[0]  # e.g. {"method": "eagle3", "adaptive": true} -> specx_eagle3
    if specx_keys:
        owners = knob_owners(specx_keys[0])
        raise _bad(
            specx_keys[0], config[specx_keys[0]],
            f"it belongs to specx method {_or(owners)}, not to vLLM's '{method}'",
        )
    return None


def _switched_off(key: str, value: Any, owners: list[str]) -> bool:
    """``value`` is the off value of an on/off knob (e.g. ``"cost_control": false``,
    ``"draft_tree": false``) for every method that owns ``key``."""
    return value is False and all(
        METHODS[m].knob(key).kind in ("bool", "tree", "switch") for m in owners)


def _or(names: list[str]) -> str:
    quoted = [f"'{n}'" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def translate(
    config: Mapping[str, Any],
    *,
    vllm_methods: Collection[str],
    vllm_fields: Collection[str],
    limits: DeviceLimits,
    device: str,
    check_available: bool = True,
) -> Translation | None:
    """Validate ``config`` and translate it if it selects a specx method.

    Returns None for vLLM's own methods (the caller must then leave the config exactly
    as it was). ``vllm_fields`` are the field names of vLLM's ``SpeculativeConfig``.
    """
    config = {k.replace("-", "_"): v for k, v in config.items()}
    name = resolve_method(config, vllm_methods)
    if name is None:
        return None
    spec = METHODS[name]
    _check_keys(config, spec, vllm_fields)

    model = config.get("model")
    if spec.needs_draft_model:
        if model is None:
            raise SpecxConfigError(
                f'speculative_config["model"] is missing for method \'{name}\': it needs a '
                "draft model (a local directory or hub id)."
            )
        if not isinstance(model, str) or not model.strip():
            raise _bad("model", model, "a draft model path or hub id (a non-empty string)", name)
    elif model is not None and not isinstance(model, str):
        raise _bad("model", model, "a model path or hub id (a non-empty string)", name)

    num_tokens = config.get("num_speculative_tokens", spec.default_num_speculative_tokens)
    # An explicit null is refused like any knob's null, except where "unset" is the
    # method's own default (specx_mtp: vLLM reads K from the MTP config).
    if num_tokens is not None or spec.default_num_speculative_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise _bad("num_speculative_tokens", num_tokens, "an integer >= 1", name)
        # The tightest K any part of the runtime (vLLM's sampler, the device) accepts.
        max_k, reason = limits.speculative_tokens_limit()
        if num_tokens > max_k:
            raise _bad("num_speculative_tokens", num_tokens,
                       f"at most {max_k} on {device} ({reason})", name)

    settings: dict[str, Any] = {"method": name, "num_speculative_tokens": num_tokens}
    vllm_knobs: dict[str, Any] = {}
    for knob in spec.knobs:
        given = knob.name in config
        value = config.get(knob.name, knob.default)
        if given:
            if not knob.type_ok(value) or (knob.check is not None and not knob.check(value)):
                raise _bad(knob.name, value, knob.allowed, name)
            # A switch turned off is no error where it would not apply anyway (e.g.
            # "cost_control": false without "adaptive": true); turned on, it is refused.
            turned_off = knob.kind in ("bool", "switch") and value is False
            if knob.requires is not None and not turned_off:
                other, needed = knob.requires
                alternative = knob.or_with is not None and config.get(
                    knob.or_with) not in (None, False)
                if config.get(other, spec.knob(other).default) != needed and not alternative:
                    also = f' or a "{knob.or_with}"' if knob.or_with else ""
                    raise _bad(
                        knob.name, value,
                        f'it only applies with "{other}": {_fmt(needed)}{also}', name,
                    )
        if knob.vllm_field:
            # vLLM's own setting: it goes to vLLM's config (when given), not to ours.
            if given:
                vllm_knobs[knob.name] = value
            continue
        settings[knob.name] = value

    context = CheckContext(spec=spec, settings=settings, model=model, limits=limits,
                           device=device)
    for check in spec.checks:
        refusal = check(context)
        if refusal is not None:
            raise _bad(refusal.key, refusal.value, refusal.allowed, name)

    vllm_config: dict[str, Any] = {"method": spec.vllm_method}
    if model is not None:
        vllm_config["model"] = model
    budget = tree_max_nodes(settings)
    if num_tokens is not None or budget is not None:
        # A draft tree is scheduled as its nodes: vLLM's K is the tree's node budget (the
        # specx settings keep the drafter's own K, e.g. mtad's beam depth; specx_mtp's
        # unset K, read by vLLM from the MTP config, does not size a tree).
        vllm_config["num_speculative_tokens"] = budget or num_tokens
    for key in sorted(PASSTHROUGH_VLLM_KEYS & config.keys()):
        vllm_config[key] = config[key]
    vllm_config.update(vllm_knobs)

    if check_available and not spec.available:
        raise SpecxConfigError(
            f'speculative_config["method"] = "{name}" is not available yet in this version of '
            f"vllm-specx (its drafter has not shipped); available specx methods: "
            f"{', '.join(sorted(m for m, s in METHODS.items() if s.available)) or 'none yet'}."
        )
    return Translation(vllm_speculative_config=vllm_config, specx_settings=settings)


def _check_keys(config: Mapping[str, Any], spec: MethodSpec, vllm_fields: Collection[str]) -> None:
    allowed = sorted(set(COMMON_KNOBS) | {k.name for k in spec.knobs} | PASSTHROUGH_VLLM_KEYS)
    for key in sorted(config):
        value = config[key]
        if key in COMMON_KNOBS or spec.knob(key) is not None or key in PASSTHROUGH_VLLM_KEYS:
            continue
        owners = knob_owners(key)
        if owners and _switched_off(key, value, owners):
            # An on/off knob of other methods, turned off: nothing to do here, no error.
            continue
        if owners:
            raise _bad(key, value, f"it belongs to specx method {_or(owners)}", spec.name)
        if key in CONFLICTING_VLLM_KEYS:
            raise _bad(key, value, f"not used with specx methods ({CONFLICTING_VLLM_KEYS[key]})",
                       spec.name)
        if key in vllm_fields:
            raise _bad(
                key, value,
                "this vLLM setting is not supported with specx methods; allowed keys: "
                + ", ".join(allowed),
                spec.name,
            )
        raise _bad(key, value, "unknown key; allowed keys: " + ", ".join(allowed), spec.name)
