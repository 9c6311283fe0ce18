"""Speculative configurations as the benchmark takes them: parsing, defaults, names.

Pure (no vLLM import). A configuration is the dict a user passes to vLLM's
``speculative_config``, plus an optional ``"name"`` that the benchmark strips.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_specx.methods import METHODS

# vLLM methods that run no draft model: their proposer works on token ids (CPU side), so a
# round costs no draft forward (t_draft = 0 in the projection).
MODEL_FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})

NAME_KEY = "name"


def is_mtp_method(method: str | None) -> bool:
    """vLLM's MTP family ("mtp", "deepseek_mtp", ...) and specx's own MTP method."""
    if not method:
        return False
    spec = METHODS.get(method)
    if spec is not None:
        return spec.vllm_method == "mtp"
    return method == "mtp" or method.endswith("_mtp")


def needs_default_draft(config: Mapping[str, Any]) -> bool:
    """True when a configuration without ``model`` should get the default draft model."""
    if config.get("model"):
        return False
    method = config.get("method")
    if method in MODEL_FREE_METHODS or is_mtp_method(method):
        return False
    spec = METHODS.get(method) if isinstance(method, str) else None
    if spec is not None:
        return spec.needs_draft_model
    return True


def is_model_free(config: Mapping[str, Any]) -> bool:
    """True for drafters that run no model (ngram, suffix): a draft costs no forward, so
    the projection prices it at t_draft = 0."""
    return config.get("method") in MODEL_FREE_METHODS


def parse_config_arg(text: str) -> tuple[str | None, dict[str, Any]]:
    """``--config`` JSON -> (name or None, the dict vLLM will receive)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {text!r} is not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--config {text!r} must be a JSON object (a speculative config)")
    name = value.pop(NAME_KEY, None)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f'--config "name" must be a non-empty string, got {name!r}')
    if "method" not in value and "model" not in value:
        raise ValueError(f'--config {text!r} needs a "method" (or a "model")')
    return name, value


def with_default_draft(config: Mapping[str, Any], draft: str | None) -> dict[str, Any]:
    """The configuration with ``model`` filled in from the default draft where needed."""
    out = dict(config)
    if needs_default_draft(out):
        if draft is None:
            raise ValueError(
                f"configuration {json.dumps(dict(config))} needs a draft model: pass --draft "
                'or add "model"'
            )
        out["model"] = str(draft)
    return out


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def default_name(config: Mapping[str, Any], default_draft: str | None = None) -> str:
    """A readable name from the knobs: ``draft_model k=4``, ``mtad k=4 num_beams=8``.

    The draft model appears only when it is not the default one.
    """
    parts = [str(config.get("method", "draft_model"))]
    if "num_speculative_tokens" in config:
        parts.append(f"k={config['num_speculative_tokens']}")
    for key in sorted(config):
        if key in ("method", "num_speculative_tokens", "model"):
            continue
        parts.append(f"{key}={_short(config[key])}")
    model = config.get("model")
    if model and (default_draft is None or str(model) != str(default_draft)):
        parts.append(f"model={str(model).rstrip('/').rsplit('/', 1)[-1]}")
    return " ".join(parts)


def unique_names(names: Iterable[str]) -> list[str]:
    """Suffix repeated names with ``#2``, ``#3``... (first one unchanged)."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return out


def needs_eagle_head(method: str | None) -> bool:
    """Methods whose ``model`` is an EAGLE head over the target's hidden states (vLLM's
    ``eagle``/``eagle3`` and the specx methods over them), not a standalone drafter."""
    spec = METHODS.get(method) if isinstance(method, str) else None
    vllm_method = spec.vllm_method if spec is not None else method
    return vllm_method in ("eagle", "eagle3")


# The real pair's draft-model tree (docs/trees.md, "A draft-model tree"): 8 nodes, 3 per
# depth. The target's forward over 9 query tokens costs about 1.2 one-token forwards at
# batch 1 (docs/benchmarks/real-pair.md, benchmarks/tree_target_cost.py), and the
# drafter's first draft is accepted about half the time, so a wide shallow tree.
REAL_PAIR_TREE: dict[str, Any] = {"max_nodes": 8, "max_depth": 3, "branching": 3}
# The shipped EAGLE-3 head's tree (docs/trees.md, "EAGLE and MTP trees"): 8 nodes, 2 per
# depth, 4 deep (the head's first draft is accepted more often than the drafter's).
REAL_PAIR_EAGLE3_TREE: dict[str, Any] = {"max_nodes": 8, "max_depth": 4, "branching": 2}


def default_configs(num_speculative_tokens: int = 4, eagle3_head: str | None = None,
                    eagle3_k: int = 3, draft_tree: Mapping[str, Any] | None = None,
                    eagle3_tree: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """What runs when no ``--config`` is given: vLLM's ngram and draft_model, and every
    specx method that is available in this version and runs on a draft model (the
    fixture pair has no MTP layers). Models are filled in from the default draft later.
    With ``draft_tree`` (the real pair's :data:`REAL_PAIR_TREE`): ``adaptive`` drafting
    that tree too. With ``eagle3_head`` (the real pair's shipped head): vLLM's ``eagle3``
    with ``eagle3_k`` drafts and ``specx_eagle3`` with the adaptive stop over the same
    head, and with ``eagle3_tree`` (:data:`REAL_PAIR_EAGLE3_TREE`) ``specx_eagle3``
    drafting that tree; without a head, no EAGLE method (the default drafter is not a
    head)."""
    configs: list[dict[str, Any]] = [
        {
            "method": "ngram",
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        {"method": "draft_model", "num_speculative_tokens": num_speculative_tokens},
    ]
    for name, spec in METHODS.items():
        if spec.available and spec.needs_draft_model and not needs_eagle_head(name):
            configs.append({"method": name})
    if draft_tree is not None:
        configs.append({"method": "adaptive", "draft_tree": dict(draft_tree)})
    if eagle3_head is not None:
        configs.append({"method": "eagle3", "model": eagle3_head,
                        "num_speculative_tokens": eagle3_k})
        configs.append({"method": "specx_eagle3", "model": eagle3_head, "adaptive": True})
        if eagle3_tree is not None:
            configs.append({"method": "specx_eagle3", "model": eagle3_head,
                            "draft_tree": dict(eagle3_tree)})
    return configs
