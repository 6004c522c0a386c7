"""GGUF import on tiny files written like llama.cpp writes them."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize

from mlx.utils import tree_flatten

from justfit.model.gguf.cache import RequantOptions, UnsupportedModel, converted_path
from justfit.model.gguf.convert import convert
from justfit.model.gguf.blocks import pack
from justfit.model.gguf.file import read_gguf
from justfit.model.models import load
from phaseswap import materialize_dense
from tests.helpers.tiny_models import finish, reference_model, write_gemma3_gguf, write_llama_gguf


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_llama_gguf(path)


@pytest.fixture(scope="module")
def gemma3_gguf_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    return path, write_gemma3_gguf(path)


def _logits(model, tokens):
    return model(mx.array(tokens)[None])[0].astype(mx.float32)


def test_q4_q8_blocks_repack_bit_exact_against_mx_load(llama_gguf, tmp_path):
    path, _ = llama_gguf
    out = convert(path, tmp_path / "m", RequantOptions())
    ours = mx.load(str(out / "model.safetensors"))
    native = mx.load(str(path))  # MLX reads Q4_0/Q4_1/Q8_0 natively
    pairs = {"blk.0.attn_q": "model.layers.0.self_attn.q_proj", "blk.1.ffn_down": "model.layers.1.mlp.down_proj",
             "blk.0.attn_k": "model.layers.0.self_attn.k_proj", "token_embd": "model.embed_tokens"}
    for g, m in pairs.items():
        ours_w = mx.dequantize(ours[m + ".weight"], ours[m + ".scales"], ours[m + ".biases"],
                               group_size=32, bits=8 if "embed" in m else 4)
        nat_w = mx.dequantize(native[g + ".weight"], native[g + ".scales"], native[g + ".biases"],
                              group_size=32, bits=8 if "embd" in g else 4)
        assert mx.array_equal(ours_w, nat_w), g


def test_llama_import_matches_reference_model(llama_gguf, tmp_path):
    path, ref = llama_gguf
    out = convert(path, tmp_path / "m", RequantOptions())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_traditional"] is True and cfg["tie_word_embeddings"] is True
    loaded = load(str(out))
    materialize_dense(loaded.model)
    # The reference runs HF-layout (un-permuted) weights with half-split RoPE: the
    # imported model must compute the same function with GGUF's permuted Q/K.
    expected = _logits(reference_model(ref), list(range(3, 40)))
    got = _logits(loaded.model, list(range(3, 40)))
    assert mx.allclose(got, expected, atol=1e-3, rtol=1e-3)


def test_gemma3_import_config_norms_and_weights(gemma3_gguf_tiny, tmp_path):
    path, ref = gemma3_gguf_tiny
    out = convert(path, tmp_path / "m", RequantOptions(bits=4))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text"
    assert cfg["sliding_window"] == 8 and cfg["sliding_window_pattern"] == 6
    assert cfg["query_pre_attn_scalar"] == 64 and cfg["head_dim"] == 64
    stored = mx.load(str(out / "model.safetensors"))
    # llama.cpp stores Gemma norms as 1 + w; mlx-lm's Gemma adds the 1 itself.
    np.testing.assert_allclose(np.array(stored["model.layers.0.input_layernorm.weight"]),
                               ref["model.layers.0.input_layernorm.weight"], atol=1e-6)
    assert cfg["quantization"]["bits"] == 4
    assert cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    assert cfg["quantization"]["model.layers.0.self_attn.v_proj"]["bits"] == 8  # Q8_0 kept


def test_native_mode_keeps_affine_types_and_requantizes_the_rest(gemma3_gguf_tiny, tmp_path):
    path, _ = gemma3_gguf_tiny
    q = json.loads((convert(path, tmp_path / "m", RequantOptions()) / "config.json").read_text())["quantization"]
    width = {m: q.get(f"model.layers.1.{m}", q)["bits"] for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")}
    assert width == {"self_attn.q_proj": 5, "self_attn.o_proj": 4, "mlp.down_proj": 8}  # Q5_0, Q4_K, Q6_K


def test_exact_mode_reproduces_gguf_dequantization(gemma3_gguf_tiny, tmp_path):
    """bits="exact": every weight equals what llama.cpp dequantizes, bit for bit."""
    path, ref = gemma3_gguf_tiny
    out = convert(path, tmp_path / "m", RequantOptions(bits="exact"))
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert q.get("model.layers.0.self_attn.q_proj", q)["bits"] == 5  # Q5_0 as 5-bit affine
    assert q.get("model.layers.0.self_attn.o_proj", q)["bits"] == 4  # Q4_K as 4-bit affine
    loaded = load(str(out))
    stored = mx.load(str(out / "model.safetensors"))
    assert "model.layers.0.mlp.down_proj.scales" not in stored  # Q6_K: dense fp32
    materialize_dense(loaded.model)
    params = dict(tree_flatten(loaded.model.parameters()))
    for name, expected in ref.items():
        if name.startswith("_"):
            continue
        np.testing.assert_array_equal(np.array(params[name]), expected.astype(np.float32), err_msg=name)


@pytest.mark.parametrize("bits,atol", [("exact", 1e-4), ("native", 0.05), (8, 0.05), (4, 0.3)])
def test_gemma3_import_tracks_reference_logits(gemma3_gguf_tiny, tmp_path, bits, atol):
    path, ref = gemma3_gguf_tiny
    loaded = load(str(convert(path, tmp_path / "m", RequantOptions(bits=bits))))
    materialize_dense(loaded.model)
    tokens = list(range(262, 290))  # longer than the 8-token sliding window
    expected = _logits(reference_model(ref), tokens)
    got = _logits(loaded.model, tokens)
    err = float(mx.abs(got - expected).max())
    spread = float(expected.max() - expected.min())
    assert err < atol * spread, (err, spread)


def test_requantized_weights_stay_within_one_step(gemma3_gguf_tiny, tmp_path):
    path, _ = gemma3_gguf_tiny
    out = convert(path, tmp_path / "m", RequantOptions(bits=4))
    stored = mx.load(str(out / "model.safetensors"))
    tensor = next(t for t in read_gguf(str(path))[1] if t.name == "blk.2.attn_output.weight")
    source = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    m = "model.layers.2.self_attn.o_proj"
    scales = stored[m + ".scales"]
    got = mx.dequantize(stored[m + ".weight"], scales, stored[m + ".biases"], group_size=32, bits=4)
    step = np.repeat(np.array(scales.astype(mx.float32)), 32, axis=1)
    fp16_rounding = 2**-10 * np.abs(source).max()  # scales and biases are stored in fp16
    # mx.quantize keeps the larger-magnitude edge exact, so the error bound is one step.
    assert np.all(np.abs(np.array(got.astype(mx.float32)) - source) <= np.abs(step) + fp16_rounding)


def test_cache_reuses_and_invalidates(llama_gguf, tmp_path, monkeypatch):
    src, _ = llama_gguf
    path = tmp_path / "copy.gguf"
    path.write_bytes(src.read_bytes())
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path / "cache"))
    first = converted_path(path)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert converted_path(path) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not converted again
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # the source changed
    assert converted_path(path) != first
    assert converted_path(path, RequantOptions(bits=8)) != converted_path(path)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mlx_layout(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=(3, 64)).astype(np.uint8)
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))
    unpacked = mx.dequantize(mx.array(pack(codes, bits)), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(unpacked).astype(np.uint8), codes)


def test_reader_matches_gguf_package(gemma3_gguf_tiny):
    from gguf import GGUFReader

    path, _ = gemma3_gguf_tiny
    meta, tensors = read_gguf(str(path))
    reader = GGUFReader(str(path))
    assert meta["tokenizer.ggml.tokens"] == reader.fields["tokenizer.ggml.tokens"].contents()
    assert meta["gemma3.attention.sliding_window"] == 8
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.name == theirs.name and ours.tensor_type == theirs.tensor_type
        np.testing.assert_array_equal(np.asarray(ours.data).reshape(-1).view(np.uint8),
                                      np.asarray(theirs.data).reshape(-1).view(np.uint8))


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or not hasattr(__import__("mmap"), "MADV_DONTNEED"),
                    reason="RssFile (Linux) and madvise measure it")
def test_a_converted_tensors_file_pages_leave_the_process(tmp_path):
    """Conversion drops each tensor's mapped file pages once copied: a large vocabulary's
    embedding otherwise counted twice (its file bytes beside its converted copy)."""
    import gguf

    from justfit.planning.breakdown import file_bytes

    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("big", np.full((1024, 4096), 0.5, np.float32))  # 16 MiB
    finish(writer)
    (tensor,) = read_gguf(str(path))[1]
    assert float(tensor.data.sum()) == 0.5 * tensor.data.size  # every page read: resident
    before = file_bytes()
    tensor.drop_pages()
    assert before - file_bytes() >= 0.9 * tensor.data.nbytes
    assert float(tensor.data.sum()) == 0.5 * tensor.data.size  # still readable, from the page cache


def test_bad_requant_options_are_refused():
    with pytest.raises(ValueError, match="bits"):
        RequantOptions(bits=7)


def test_unsupported_architecture_is_refused(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_tensor("x.weight", np.zeros((4, 4), np.float32))
    finish(w)
    with pytest.raises(UnsupportedModel, match="mamba"):
        convert(path, tmp_path / "m", RequantOptions())
    assert not (tmp_path / "m").exists()
