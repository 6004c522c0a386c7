"""Per-model KV calibration: the allocation of the KL budget over the layers, determinism, the cache per
model identity, and a calibrated (mixed) configuration the caches and planner follow."""

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import kvexec
import kvexec.calibrate as calibrate_mod
from kvexec import KVConfig, get_format
from kvexec.calibrate import Calibration, Measurement, allocate, cached_calibration, calibrate, calibrated_config, measure
from tests.helpers.tiny_paged import ByteTokenizer, paged_model

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=3, intermediate_size=96, num_attention_heads=2,
            num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)
CANDIDATES = ("k4crv3r", "k4crv4r", "k6cv4r", "q8c")


@pytest.fixture(scope="module")
def tiny_model():
    return paged_model(TINY)


def test_calibration_spends_the_kl_budget_within_tolerance_and_is_deterministic(tiny_model):
    a = calibrate(tiny_model, ByteTokenizer(), "tiny", CANDIDATES, tolerance=0.05, max_tokens=600)
    b = calibrate(tiny_model, ByteTokenizer(), "tiny", CANDIDATES, tolerance=0.05, max_tokens=600)
    assert a == b and len(a.formats) == 3 and a.tokens == 600
    sizes = [get_format(c).bytes_per_token(1, 64) for c in a.candidates]
    assert sizes == sorted(sizes)  # candidates are tried smallest first
    assert a.gain > 0  # the output moved when every layer's pages were quantized
    # within the KL budget as predicted (gain x summed squared errors), and no layer could
    # take a smaller candidate and stay within it
    predicted = lambda formats: a.gain * sum(e[get_format(f).label] ** 2 for f, e in zip(formats, a.errors))  # noqa: E731
    assert predicted(a.formats) <= 0.05
    for i, chosen in enumerate(a.formats):
        for smaller in a.candidates[: a.candidates.index(get_format(chosen).label)]:
            assert predicted(a.formats[:i] + (smaller,) + a.formats[i + 1:]) > 0.05
    # the errors order the formats as their widths do: 8-bit pages lose least
    assert all(e["q8c"] < e["k4crv3r"] for e in a.errors)
    tight = calibrate(tiny_model, ByteTokenizer(), "tiny", CANDIDATES, tolerance=1e-9, max_tokens=600)
    assert tight.formats == ("q8c",) * 3  # nothing fits: the widest candidate


def test_gain_is_the_mean_of_draws_with_the_groups_shifted(tiny_model, monkeypatch):
    seen = []
    real = calibrate_mod.output_kl

    def draw(model, ids, config, ref, chunk=256):
        kl = real(model, ids, config, ref, chunk)
        seen.append((config.sink_tokens, config.layer_formats, kl))
        return kl

    monkeypatch.setattr(calibrate_mod, "output_kl", draw)
    m = measure(tiny_model, ByteTokenizer(), "tiny", CANDIDATES, max_tokens=600)
    sinks = [s for s, _, _ in seen]
    assert sinks == [calibrate_mod.LAYOUT.sink_tokens + i for i in range(calibrate_mod.PROBE_DRAWS)]
    assert len({f for _, f, _ in seen}) == 1  # every draw in the same probe formats
    assert len({kl for *_, kl in seen}) > 1  # shifted groups: other draws of the noise
    squared = sum(e[get_format(f).label] ** 2 for f, e in zip(seen[0][1], m.errors))
    assert m.gain == pytest.approx(sum(kl for *_, kl in seen) / len(seen) / squared, rel=1e-5)


def test_allocate_spends_the_budget_where_a_step_is_cheap():
    costs, errors = [[1, 2], [1, 2]], [[0.5, 0.05], [0.2, 0.0]]
    # predicted KL 0.25 + 0.04 fits 0.3 as it is (an even split, sqrt(0.15) = 0.39 a layer,
    # would have stepped the first layer up)
    assert allocate(costs, errors, 1.0, 0.3) == [0, 0]
    assert allocate(costs, errors, 1.0, 0.2) == [1, 0]  # the step that saves most per byte
    assert allocate(costs, errors, 1.0, 0.01) == [1, 1]
    rng = np.random.default_rng(0)
    for _ in range(200):  # within the budget wherever the least errors are, no layer able to step down
        layers, steps = int(rng.integers(1, 6)), int(rng.integers(2, 5))
        costs = np.cumsum(rng.uniform(0.1, 1.0, (layers, steps)), axis=1).tolist()
        errors = np.sort(rng.uniform(0.0, 1.0, (layers, steps)), axis=1)[:, ::-1].tolist()
        tolerance = float(rng.uniform(0.0, layers * 0.5))
        picks = allocate(costs, errors, 1.0, tolerance)
        kl = [e[j] ** 2 for e, j in zip(errors, picks)]
        if sum(e[-1] ** 2 for e in errors) <= tolerance:
            assert sum(kl) <= tolerance
            assert all(sum(kl) - kl[i] + errors[i][j] ** 2 > tolerance for i in range(layers) for j in range(picks[i]))
    assert allocate([[1, 2]], [[0.5, 0.6]], 1.0, 0.01) == [0]  # nothing fits: the least error


def test_calibration_is_cached_per_model_identity(tiny_model, tmp_path, monkeypatch):
    first = cached_calibration(tiny_model, ByteTokenizer(), "tiny-a", tmp_path, CANDIDATES, 0.05)
    files = list(tmp_path.glob("kv-calibration-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["errors"] == [dict(e) for e in first.errors]

    def measured_again(*args, **kwargs):
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr(calibrate_mod, "measure", measured_again)
    assert cached_calibration(tiny_model, ByteTokenizer(), "tiny-a", tmp_path, CANDIDATES, 0.05) == first
    # another tolerance chooses from the same measurement
    assert cached_calibration(tiny_model, ByteTokenizer(), "tiny-a", tmp_path, CANDIDATES, 1e-9).formats == \
        ("q8c",) * 3
    monkeypatch.undo()
    other = cached_calibration(tiny_model, ByteTokenizer(), "tiny-b", tmp_path, CANDIDATES, 0.05)
    assert other.model == "tiny-b" and len(list(tmp_path.glob("kv-calibration-*.json"))) == 2
    files[0].write_text("{not json")  # a damaged cache file is measured again, not trusted
    assert cached_calibration(tiny_model, ByteTokenizer(), "tiny-a", tmp_path, CANDIDATES, 0.05) == first


def test_calibrated_config_sets_each_layers_format_and_the_planner_counts_it(tiny_model):
    cal = Calibration("tiny", ("q8c", "k4crv4r", "k6cv4r"), ({}, {}, {}), 0.05, CANDIDATES, 600)
    kv = calibrated_config(KVConfig(page_size=128), cal)
    cache = kvexec.make_cache(tiny_model, kv)
    assert [c.store.fmt.name for c in cache] == list(cal.formats)
    tiny_model(mx.array(list(range(200)) * 3)[None], cache=cache)
    assert kvexec.page_formats(cache) == {f: 256 for f in cal.formats}  # 600 - sinks - hot window: 2 pages
    mean = sum(get_format(f).bytes_per_token(1, 64) for f in cal.formats) / 3
    assert kvexec.page_bytes_per_token(kv, 1, 64) == pytest.approx(mean)
    assert cal.bits_per_value(1, 64) == pytest.approx(8 * mean / 128)
    with pytest.raises(ValueError, match="layer"):
        kvexec.make_cache(tiny_model, calibrated_config(KVConfig(), Calibration("tiny", ("q8c",), ({},), 0.05,
                                                                                 CANDIDATES, 600)))


def test_allocated_candidates_get_their_widths_per_layer(tiny_model):
    cal = calibrate(tiny_model, ByteTokenizer(), "tiny", ("k5a128v4r", "k6a128v4r", "q8c"), tolerance=1.0,
                    max_tokens=600)
    assert cal.candidates == ("k5a128v4r", "k6a128v4r", "q8c")
    assert all(get_format(f).label == "k5a128v4r" for f in cal.formats)  # everything fits tolerance 1
    assert len(set(cal.formats)) == 3  # each layer's widths come from its own queries and keys
    assert cal.summary() == "k5a128v4r x3"
    cache = kvexec.make_cache(tiny_model, calibrated_config(KVConfig(page_size=128), cal))
    tiny_model(mx.array(list(range(250)) * 2)[None], cache=cache)
    assert [c.store.formats() for c in cache] == [{f: 128} for f in cal.formats]
    assert kvexec.page_formats(cache) == {"k5a128v4r": 3 * 128}  # summed by label


def test_a_head_dim_no_candidate_stores_is_calibrated_to_fp16(tiny_model):
    odd = calibrate(tiny_model, ByteTokenizer(), "tiny", ("k4crv4r128",), max_tokens=300)
    assert odd.formats == ("fp16",) * 3


def test_engine_calibrates_on_first_load_and_reuses_it(tiny_gemma3_dir, tmp_path, monkeypatch, caplog):
    from justfit import Engine, SamplingParams
    from justfit.config import EngineConfig

    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path))
    config = EngineConfig(kv=KVConfig(format="k5a128v4r", page_size=128, hot_window=0))
    before = mx.get_active_memory()
    with caplog.at_level("INFO", logger="justfit.loader"):
        engine = Engine(str(tiny_gemma3_dir), config=config)
    assert any("measuring" in r.getMessage() for r in caplog.records)  # the wait is named
    # the second copy it measured on is gone: what MLX holds after the load is the weights
    assert mx.get_active_memory() - before <= engine.swap.registry.resident_bytes() + (64 << 10)
    formats = engine.config.kv.layer_formats
    assert len(formats) == 6 and {get_format(f).label for f in formats} == {"k5a128v4r"}
    assert len(list((tmp_path / "calibration").glob("kv-calibration-*.json"))) == 1
    # ignore_eos: a random model's greedy tokens hinge on rounding (the prefill forms are
    # chosen by timing), and an early EOS is not what this checks
    reply = engine.reply(list(range(3, 300)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(reply.tokens) == 4
    assert set(reply.stats.kv_formats) == {"k5a128v4r"}  # pages written as calibrated

    def measured_again(*args, **kwargs):
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr(calibrate_mod, "measure", measured_again)
    import justfit.model.loader

    monkeypatch.setattr(justfit.model.loader, "load_lazily", measured_again)  # a cached load needs no second copy
    caplog.clear()
    with caplog.at_level("INFO", logger="justfit.loader"):
        again = Engine(str(tiny_gemma3_dir), config=config)
    assert again.config.kv.layer_formats == formats
    assert not caplog.records  # nothing measured, nothing to wait for


def test_a_sliding_layers_bytes_count_as_its_share_of_the_trained_context():
    """Two layers alike but for a window: stepping the sliding one up costs 1/64 of the
    full one's bytes at the trained context, so it keeps its widest candidate, even
    where the budget would allow less, and the budget goes to the full layer."""
    names = ("k4crv4r", "q8c")
    errors = ({"k4crv4r": 0.3, "q8c": 0.05},) * 2
    alike = Measurement("m", names, (names, names), errors, 100, 1.0, 64, (1.0, 1.0))
    windowed = Measurement("m", names, (names, names), errors, 100, 1.0, 64, (1.0, 1 / 64))
    assert alike.choose(0.1).formats == ("q8c", "k4crv4r")  # equals: the first layer steps
    assert alike.choose(1.0).formats == ("k4crv4r", "k4crv4r")
    assert windowed.choose(1.0).formats == ("k4crv4r", "q8c")
    assert windowed.choose(0.09).formats == ("q8c", "q8c")  # 0.3**2 + 0.05**2 is over 0.09
    chosen = windowed.choose(0.1)
    assert chosen.formats == ("k4crv4r", "q8c") and chosen.shares == (1.0, 1 / 64)
    assert chosen.bits_per_value(1, 64, growing=True) == pytest.approx(get_format("k4crv4r").bits_per_value(1, 64))
    assert chosen.bits_per_value(1, 64) == pytest.approx(
        (get_format("k4crv4r").bits_per_value(1, 64) + get_format("q8c").bits_per_value(1, 64)) / 2)


def test_calibration_weighs_sliding_layers_and_the_planner_counts_each_kind(tiny_gemma3_dir):
    from justfit.model.models import load
    from justfit.planning.cost_model import footprint

    loaded = load(str(tiny_gemma3_dir))
    kvexec.install(loaded.model)
    m = measure(loaded.model, loaded.tokenizer, "g", ("k4crv4r", "q8c"), max_tokens=200, context=512)
    assert m.shares == (16 / 512,) * 5 + (1.0,)  # five sliding layers of window 16, one full
    kv = KVConfig(page_size=32, block_tokens=64, layer_formats=("q8c",) * 5 + ("k4crv4r",))
    fp = footprint(loaded.model, loaded.config, 1024, 128, kv)
    small, wide = (get_format(f).bytes_per_token(1, 32) for f in ("k4crv4r", "q8c"))
    assert fp.shape.page_row == small and fp.shape.window_row == wide
    assert fp.shape.bytes_per_position == small + 5 * wide
    # past the windows only the full layer grows, by its own format's bytes per position
    grown = footprint(loaded.model, loaded.config, 1024 + 640, 128, kv).kv - fp.kv
    assert grown == pytest.approx(640 * small)
    cache = kvexec.make_cache(loaded.model, replace(kv, hot_window=0))
    loaded.model(mx.array(list(range(3, 203)))[None], cache=cache)
    assert [c.store.fmt.name for c in cache] == list(kv.layer_formats)
    assert kvexec.page_formats(cache)["k4crv4r"] == 192  # 200 - 4 sinks, whole pages; the rings hold ~16


def test_output_log_probabilities_are_taken_a_few_rows_at_a_time():
    import tracemalloc

    import numpy as np

    from kvexec.layer_error import _log_softmax_rows

    logits = mx.random.normal((1, 256, 8192)) * 4
    mx.eval(logits)
    x = np.array(logits[0])
    whole = x - x.max(axis=-1, keepdims=True)
    whole = whole - np.log(np.exp(whole).sum(axis=-1, keepdims=True))
    tracemalloc.start()
    parts = [lp for _, lp in _log_softmax_rows(logits)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert np.array_equal(np.concatenate(parts), whole)  # row by row: the same numbers
    # float32 copies of a few rows, not of the chunk (Gemma 3's 262,144-token rows: GiBs)
    assert peak - sum(p.nbytes for p in parts) < x.nbytes / 2


def test_recording_the_reference_holds_a_few_rows_of_the_vocabulary_at_a_time():
    import tracemalloc

    from kvexec.calibrate import LAYOUT
    from kvexec.layer_error import ROWS, TOP, record

    vocab = 32768
    model = paged_model({**TINY, "vocab_size": vocab})
    tracemalloc.start()
    _, ref = record(model, list(range(3, 259)), LAYOUT)  # one 256-position chunk
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert ref.tokens[0].shape == (256, TOP)
    one_slice = ROWS * vocab * 8  # the top-k index array of one slice of rows
    assert peak < 8 * one_slice  # not the chunk's rows (or every slice's index array) at once


def test_the_reference_applies_the_head_a_few_rows_at_a_time_with_the_same_numbers(monkeypatch):
    import gc

    from kvexec import layer_error
    from kvexec.calibrate import LAYOUT

    vocab, ids = 32768, list(range(3, 259))  # one 256-position chunk
    model = paged_model({**TINY, "vocab_size": vocab})
    split = layer_error._split(model, ids, LAYOUT)
    assert split is not None  # mlx-lm's shape: head(body(x))

    def recorded():
        gc.collect()
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        _, ref = layer_error.record(model, ids, LAYOUT)
        return ref, mx.get_peak_memory() - before

    by_rows, rows_peak = recorded()
    monkeypatch.setattr(layer_error, "_split", lambda *_: None)  # the model's whole logits, as before
    whole, whole_peak = recorded()
    # The same body, the head's product on 8 rows against 256: a BLAS may block the rows
    # otherwise and sum each logit's hidden_size products in another order (OpenBLAS's
    # Haswell and Zen kernels do). Two orders of a K-term fp32 sum differ by at most
    # 2 * gamma_K * sum |h_k w_k| (gamma_K = K u / (1 - K u), u = 2^-24); a log-probability
    # moves by at most twice its logits' largest change, plus numpy's own rounding.
    body, _ = split
    hidden = np.abs(np.array(body(mx.array(ids)[None], cache=kvexec.make_cache(model, LAYOUT))[0]))
    weight = np.abs(np.array(model.model.embed_tokens.weight))  # the tied head
    k, u = hidden.shape[-1], 2.0 ** -24
    gamma = k * u / (1 - k * u)
    logit_bound = 2 * gamma * float((hidden @ weight.T).max())
    bound = 2 * logit_bound + 8 * u * max(float(np.abs(lp).max()) for lp in whole.logprobs)
    # the rest, log(1 - s) of the top tokens' mass s, moves by at most s / (1 - s) times that
    top_mass = max(float(np.exp(lp).sum(axis=-1).max()) for lp in whole.logprobs)
    rest_bound = bound * top_mass / (1 - top_mass) + 8 * u * max(float(np.abs(r).max()) for r in whole.rest)
    for a, b in zip(by_rows.tokens, whole.tokens):
        assert np.array_equal(a, b)  # the top tokens: far further apart than the bound
    for a, b in zip(by_rows.logprobs, whole.logprobs):
        assert float(np.abs(a - b).max()) <= bound, (float(np.abs(a - b).max()), bound)
    for a, b in zip(by_rows.rest, whole.rest):
        assert float(np.abs(a - b).max()) <= rest_bound, (float(np.abs(a - b).max()), rest_bound)
    logits = len(ids) * vocab * 4  # the chunk's float32 logits
    assert whole_peak >= logits and rows_peak < whole_peak - logits // 2, (rows_peak, whole_peak)


def test_a_model_whose_call_does_more_than_its_head_keeps_its_whole_logits():
    from kvexec import layer_error
    from kvexec.calibrate import LAYOUT

    model = paged_model(TINY)
    plain = type(model)
    model.__class__ = type("Capped", (plain,), {"__call__": lambda self, *a, **k: 0.5 * plain.__call__(self, *a, **k)})
    ids = list(range(3, 40))
    assert layer_error._split(model, ids, LAYOUT) is None
    _, ref = layer_error.record(model, ids, LAYOUT)
    # the capped model's own distribution: halved logits spread the mass
    model.__class__ = plain
    _, uncapped = layer_error.record(model, ids, LAYOUT)
    assert ref.logprobs[0].max() < uncapped.logprobs[0].max()
