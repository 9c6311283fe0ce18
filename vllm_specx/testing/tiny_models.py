"""Tiny, real, locally built models for tests: no model hub, deterministic.

* :func:`build_tokenizer` trains a byte-level BPE tokenizer on a few Python standard
  library sources and saves it in Hugging Face format (``tokenizer.json`` plus
  ``tokenizer_config.json`` and ``special_tokens_map.json``) that both vLLM and
  transformers load. Special tokens: ``<unk>``=0, ``<s>``=1 (BOS, prepended by the
  post-processor), ``</s>``=2 (EOS), ``<pad>``=3.
* :func:`make_tiny_llama` saves a random-weight ``LlamaForCausalLM`` (float32,
  safetensors, config + generation config) with that tokenizer next to it.
* :func:`target_and_draft` makes a compatible target/draft pair: same tokenizer and
  vocabulary, and a draft that is the target's first layer(s) with the target's
  embeddings, final norm and LM head, so it agrees with the target often but not
  always (both the accept and the reject paths of speculative decoding run).
* :func:`make_heterogeneous_vocab_draft` rewrites a draft so that its tokenizer differs
  from the target's (other ids, draft-only tokens, missing tokens) while what it
  computes on the shared tokens stays known: the fixture for ``use_heterogeneous_vocab``.

The tokenizer depends only on the training text, which is the listed standard library
modules of the running Python; it is identical run to run on one interpreter.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
DEFAULT_VOCAB_SIZE = 512
# Standard library modules whose source is the training text: plain, stable, and
# present in every CPython.
CORPUS_MODULES = ("textwrap", "heapq", "bisect", "fractions", "colorsys", "string")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def corpus_texts(modules: tuple[str, ...] = CORPUS_MODULES) -> list[str]:
    """The training text: source of the given standard library modules, in order."""
    import importlib

    return [inspect.getsource(importlib.import_module(name)) for name in modules]


def _tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }


def build_tokenizer(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_max_length: int = 2048,
) -> Path:
    """Train and save the byte-level BPE tokenizer into ``out_dir``; returns it.

    Deterministic: the same Python and ``vocab_size`` give the same ``tokenizer.json``
    byte for byte.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(), trainer=trainer)
    # Prepend BOS the way Llama tokenizers do, for both vLLM and transformers.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, BOS_ID)],
    )
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name!r} got id {tok.token_to_id(name)}, not {i}")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(model_max_length), indent=2) + "\n"
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}, indent=2
        )
        + "\n"
    )
    return out


def cached_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """A shared, built-once copy of :func:`build_tokenizer` under the temp directory.

    Keyed by the training text and ``vocab_size``; safe when several processes race
    (each builds into its own directory and renames it into place).
    """
    digest = hashlib.sha256()
    for text in corpus_texts():
        digest.update(text.encode())
    digest.update(str(vocab_size).encode())
    root = Path(tempfile.gettempdir()) / "vllm_specx_tiny_tokenizers"
    final = root / digest.hexdigest()[:16]
    if all((final / f).is_file() for f in TOKENIZER_FILES):
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix="build-"))
    build_tokenizer(staging, vocab_size=vocab_size)
    try:
        staging.rename(final)
    except OSError:  # another process won the race
        shutil.rmtree(staging, ignore_errors=True)
    return final


def tokenizer_vocab_size(tokenizer_dir: str | os.PathLike) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab_size()


def _llama_config(
    *,
    num_hidden_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    initializer_range: float,
):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def _save_model(model, path: Path, tokenizer_dir: Path) -> Path:
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    # Only token ids: no sampling defaults that vLLM would pick up from here.
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(
        path
    )
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, path / name)
    return path


def make_tiny_llama(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.05,
) -> Path:
    """Save a random-weight float32 ``LlamaForCausalLM`` plus tokenizer at ``path``.

    ``vocab_size`` defaults to the tokenizer's and may be larger (padding rows), never
    smaller. Head size is ``hidden_size // num_attention_heads``; vLLM's CPU attention
    needs it to be one of 32, 64, 80, 96, 112, 128, ... . The weights are a function
    of ``seed`` and the shape arguments only.
    """
    import torch
    from transformers import LlamaForCausalLM

    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else cached_tokenizer()
    tok_vocab = tokenizer_vocab_size(tok_dir)
    vocab = tok_vocab if vocab_size is None else vocab_size
    if vocab < tok_vocab:
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer's {tok_vocab}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by heads, heads by kv heads")
    config = _llama_config(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    return _save_model(model.eval(), Path(path), tok_dir)


@dataclass(frozen=True)
class ModelPair:
    target: Path
    draft: Path


def make_truncated_draft(
    target_dir: str | os.PathLike, path: str | os.PathLike, *, keep_layers: int = 1
) -> Path:
    """A draft made of the target's first ``keep_layers`` decoder layers plus its
    embeddings, final norm and LM head (same tokenizer, same vocabulary)."""
    import torch
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    if not 0 < keep_layers <= target.config.num_hidden_layers:
        raise ValueError(f"keep_layers={keep_layers} out of range")
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = keep_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:keep_layers]
    draft = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = draft.load_state_dict(target.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"draft weights missing from target: {missing}")
    return _save_model(draft.eval(), Path(path), Path(target_dir))


def target_and_draft(
    tmpdir: str | os.PathLike,
    *,
    seed: int = 0,
    target_layers: int = 2,
    draft_layers: int = 1,
    **model_kwargs,
) -> ModelPair:
    """Make ``tmpdir/target`` (a tiny Llama) and ``tmpdir/draft`` (its first
    ``draft_layers`` layers), sharing tokenizer and vocabulary."""
    root = Path(tmpdir)
    target = make_tiny_llama(
        root / "target", seed=seed, num_hidden_layers=target_layers, **model_kwargs
    )
    draft = make_truncated_draft(target, root / "draft", keep_layers=draft_layers)
    return ModelPair(target=target, draft=draft)


# A Python snippet whose most frequent tokens the draft-only tokens shadow (below): the
# draft predicts these tokens often, so an unconstrained draft would often pick a shadow.
SHADOW_TEXT = (
    "def __init__(self, name, value=None):\n"
    "        self.name = name\n"
    "        self.value = value\n"
    "        if value is None:\n"
    "            return self.name\n"
    "        return (self.name, self.value)\n"
)
DRAFT_ONLY_TOKEN = "<|draft_only_{}|>"


@dataclass(frozen=True)
class HeterogeneousVocabDraft:
    """A draft whose tokenizer differs from its source's (see
    :func:`make_heterogeneous_vocab_draft`)."""

    path: Path
    # new draft id -> the source id of the same token (-1: a draft-only token)
    source_id: list[int]
    dropped: list[str]  # source tokens the new tokenizer does not have
    draft_only: dict[str, int]  # draft-only token -> the source id it shadows


def make_heterogeneous_vocab_draft(
    draft_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    draft_only_tokens: int = 16,
    drop_tokens: int = 0,
    drop_from_text: str | None = None,
    shadow_scale: float = 1.5,
) -> HeterogeneousVocabDraft:
    """Rewrite a byte-level-BPE Llama draft so that its tokenizer differs from the
    target's the ways real tokenizer pairs do, keeping what the draft computes:

    * ids: every non-special token gets a new id (a seeded permutation);
    * draft-only tokens: ``draft_only_tokens`` added tokens the target lacks; each one's
      embedding/LM-head row is ``shadow_scale`` times the row of one of the source's most
      frequent tokens on :data:`SHADOW_TEXT`, so without vLLM's vocabulary constraint the
      draft would often prefer a token that has no target id;
    * target-only tokens: ``drop_tokens`` BPE tokens (leaves of the merge tree, so the
      rest of the tokenizer still works) are removed with their merges; the target's copy
      of such a token reaches the draft as vLLM's fallback id. With ``drop_from_text``
      they are chosen among the leaves that occur in that text's tokenisation, so that a
      test's prompts surely contain some.

    With ``drop_tokens=0`` the draft restricted to the shared vocabulary computes the
    source draft's distribution exactly, under other ids: drafts translated back into
    target ids must equal the source draft's. Special tokens keep their ids.
    """
    import random

    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    src, out = Path(draft_dir), Path(out_dir)
    tok_json = json.loads((src / "tokenizer.json").read_text())
    model = tok_json["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{src}: expected a BPE tokenizer, got {model.get('type')}")
    vocab: dict[str, int] = model["vocab"]
    special_ids = {t["id"] for t in tok_json["added_tokens"]}
    rng = random.Random(seed)

    source_tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    counts: dict[int, int] = {}
    for tid in source_tok.encode(SHADOW_TEXT).ids:
        if tid not in special_ids:
            counts[tid] = counts.get(tid, 0) + 1
    shadows = sorted(counts, key=lambda t: (-counts[t], t))[:draft_only_tokens]
    if len(shadows) < draft_only_tokens:
        raise ValueError(f"SHADOW_TEXT has only {len(shadows)} distinct tokens")

    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    used = {part for m in merges for part in m}
    id_to_token = {i: t for t, i in vocab.items()}
    shadow_set = set(shadows)
    leaves = sorted(
        "".join(m) for m in merges
        if "".join(m) not in used and vocab["".join(m)] not in shadow_set
    )
    if drop_from_text is not None:
        present = {id_to_token[i] for i in source_tok.encode(drop_from_text).ids}
        leaves = [t for t in leaves if t in present]
    if len(leaves) < drop_tokens:
        raise ValueError(f"only {len(leaves)} droppable tokens, {drop_tokens} asked for")
    dropped = rng.sample(leaves, drop_tokens)
    dropped_set = set(dropped)
    model["merges"] = [m for m in merges if "".join(m) not in dropped_set]

    movable = [i for i in sorted(id_to_token) if i not in special_ids
               and id_to_token[i] not in dropped_set]
    rng.shuffle(movable)
    source_id = sorted(special_ids) + movable  # new id -> source id
    if source_id[: len(special_ids)] != list(range(len(special_ids))):
        raise ValueError("special tokens must be the first ids of the source vocabulary")
    model["vocab"] = {id_to_token[old]: new for new, old in enumerate(source_id)}
    draft_only = {}
    for i, shadow in enumerate(shadows):
        name = DRAFT_ONLY_TOKEN.format(i)
        draft_only[name] = shadow
        tok_json["added_tokens"].append({
            "id": len(source_id), "content": name, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })
        source_id.append(-1)

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = len(source_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    weights = load_file(str(src / "model.safetensors"))
    index = torch.tensor([s if s >= 0 else 0 for s in source_id])
    rows = torch.tensor(shadows)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            old = weights[name]
            new = old[index].clone()
            new[len(source_id) - len(shadows):] = shadow_scale * old[rows]
            weights[name] = new.contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return HeterogeneousVocabDraft(
        path=out, source_id=source_id, dropped=dropped, draft_only=draft_only
    )
