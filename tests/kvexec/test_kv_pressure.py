"""KVExec under a page byte limit: pages step down the pressure ladder (oldest and
widest first), attention stays exact on what is stored, snapshots keep each page's
format, and the engine engages the ladder only when the budget needs it."""

import mlx.core as mx
import numpy as np
import pytest

import kvexec
from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.planning.cost_model import MIN_PREFILL_CHUNK
from kvexec import KVConfig, PageStore, blockwise_attention, ladder
from kvexec.export import export_store, restore_store

SMALL = dict(page_size=32, hot_window=16, sink_tokens=2, block_tokens=64)


def _pressed_store(limit_share: float):
    """A store fed 1,024 tokens with its page limit at `limit_share` of what the
    page format alone would take (within reach of the ladder's last step)."""
    config = KVConfig(**SMALL)
    steps = ladder(config, 64)
    full = PageStore(config)
    rng = np.random.default_rng(0)
    kv = [mx.array(rng.normal(size=(1, 3, 64, 64)).astype(np.float32)) for _ in range(32)]
    for i in range(0, 32, 2):
        full.append(kv[i], kv[i + 1])
    store = PageStore(config)
    store.page_limit = int(limit_share * full.page_bytes())
    worst = 0
    for i in range(0, 32, 2):
        store.append(kv[i], kv[i + 1])
        worst = max(worst, store.page_bytes())
    keys = mx.concatenate(kv[0::2], axis=2)
    values = mx.concatenate(kv[1::2], axis=2)
    return store, steps, worst, keys, values


def test_ladder_steps_down_and_skips_what_is_not_smaller():
    names = [f.name for f in ladder(KVConfig(), 64)]
    assert names == ["q8c", "k8cv4", "q4c", "q3c"]
    sizes = [f.bytes_per_token(3, 64) for f in ladder(KVConfig(), 64)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert [f.name for f in ladder(KVConfig(format="q2c"), 64)] == ["q2c"]  # nothing below it
    assert [f.name for f in ladder(KVConfig(pressure=()), 64)] == ["q8c"]
    with pytest.raises(ValueError, match="unknown KV format"):
        KVConfig(pressure=("q5",))


@pytest.mark.parametrize("share", [0.8, 0.6])
def test_pages_stay_within_the_limit_oldest_and_widest_first(share):
    store, steps, worst, _, _ = _pressed_store(share)
    assert worst <= store.page_limit
    levels = [steps.index(s.fmt) for s in store.segments]
    assert levels[-1] == 0  # the segment being filled keeps the page format
    stepped = levels[:-1]
    assert max(stepped) > 0
    assert max(stepped) - min(stepped) <= 1  # every page steps once before any steps twice
    assert stepped == sorted(stepped, reverse=True)  # the oldest go first
    deeper = _pressed_store(share - 0.15)[0]  # a tighter limit steps further
    assert sum(steps.index(s.fmt) for s in deeper.segments) > sum(levels)


@pytest.mark.parametrize("share", [0.9, 0.75, 0.6, 0.45])
def test_pages_step_no_deeper_than_the_limit_needs(share):
    """Segments of up to 8 pages: under the limit a new segment is made only as large as
    fits (making room for a doubled one would step every older page down at once), and
    stepped-down neighbours coalesce again, so blocks stay few."""
    config = KVConfig(page_size=32, hot_window=16, sink_tokens=2, block_tokens=256)
    steps = ladder(config, 64)
    rng = np.random.default_rng(1)
    kv = [mx.array(rng.normal(size=(1, 3, 64, 64)).astype(np.float32)) for _ in range(64)]
    full, store = PageStore(config), PageStore(config)
    for i in range(0, 64, 2):
        full.append(kv[i], kv[i + 1])
    store.page_limit = int(share * full.page_bytes())
    worst = 0
    for i in range(0, 64, 2):
        store.append(kv[i], kv[i + 1])
        worst = max(worst, store.page_bytes())
    assert worst <= store.page_limit
    # the shallowest rung that would hold every page within the limit
    need = next(i for i, f in enumerate(steps) if f.bytes_per_token(3, 64) <= share * steps[0].bytes_per_token(3, 64))
    assert max(steps.index(s.fmt) for s in store.segments) == need
    paged = sum(s.length for s in store.segments)
    assert len(store.segments) <= -(-paged // 256) + 2
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(0))  # attention reads the joined segments
    held_k = mx.concatenate([b.fmt.keys.decode(b.keys) for b in store.blocks()], axis=2)
    held_v = mx.concatenate([b.fmt.values.decode(b.values) for b in store.blocks()], axis=2)
    ref = mx.fast.scaled_dot_product_attention(q, held_k, held_v, scale=0.125)
    assert float(mx.abs(blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125) - ref).max()) < 2e-4


def test_a_tighter_limit_takes_unwritten_room_before_any_page_steps_down():
    """Room a segment was allocated under a looser limit (or none) and no page is
    written in goes back first: a limit that holds the written pages steps none down,
    attention reads the same, and the pages grow again within the limit."""
    config = KVConfig(page_size=32, hot_window=16, sink_tokens=2, block_tokens=256)
    store = PageStore(config)
    rng = np.random.default_rng(2)
    kv = [mx.array(rng.normal(size=(1, 3, 50, 64)).astype(np.float32)) for _ in range(8)]
    for i in range(0, 8, 2):
        store.append(kv[i], kv[i + 1])
    last = store.segments[-1]
    assert last.length < last.capacity  # doubling segments: room allocated ahead
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(3))
    before = blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125)
    written = sum(s.length for s in store.segments) * store.fmt.bytes_per_token(3, 64)
    store.limit(int(written))
    assert store.page_bytes() == written and {s.fmt for s in store.segments} == {store.fmt}
    assert store.segments[-1].capacity == store.segments[-1].length
    assert mx.array_equal(blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125), before)
    store.limit(int(written + 2 * 32 * store.fmt.bytes_per_token(3, 64)))  # room for two more pages
    store.append(kv[0][..., :40, :], kv[1][..., :40, :])
    assert store.page_bytes() <= store.page_limit and {s.fmt for s in store.segments} == {store.fmt}


def test_attention_is_exact_on_stepped_down_pages():
    """The executor reads each page in its own format: its output equals reference
    attention over the keys and values the pages now hold."""
    store, steps, _, keys, values = _pressed_store(0.55)
    assert len({s.fmt.name for s in store.segments}) >= 2
    held_k = mx.concatenate([b.fmt.keys.decode(b.keys) for b in store.blocks()], axis=2)
    held_v = mx.concatenate([b.fmt.values.decode(b.values) for b in store.blocks()], axis=2)
    for L in (1, 48):  # decode (scored on the stored form) and a prefill chunk (decoded blocks)
        q = mx.random.normal((1, 9, L, 64), key=mx.random.key(L))
        out = blockwise_attention(q, store.blocks(q), store.offset - L, 0.125)
        qpos, kpos = mx.arange(store.offset - L, store.offset)[:, None], mx.arange(store.offset)[None]
        ref = mx.fast.scaled_dot_product_attention(q, held_k, held_v, scale=0.125, mask=kpos <= qpos)
        assert float(mx.abs(out - ref).max()) < 2e-4
    # re-encoding a page costs little beyond encoding it in that format at once
    for seg in store.segments:
        a, b = seg.start, seg.start + seg.length
        stored = seg.fmt.values.decode(seg.fmt.values.view(seg.values, 0, seg.length))
        direct = seg.fmt.values.decode(seg.fmt.values.encode(values[:, :, a:b]))
        err = float(mx.abs(stored - values[:, :, a:b]).mean())
        assert err <= 1.25 * float(mx.abs(direct - values[:, :, a:b]).mean()) + 1e-3


def test_snapshot_keeps_each_pages_format():
    store, _, _, _, _ = _pressed_store(0.55)
    arrays, meta = export_store(store)
    back = restore_store(arrays, meta)
    assert back.formats() == store.formats() and len(back.formats()) >= 2
    q = mx.random.normal((1, 9, 1, 64))
    a = blockwise_attention(q, store.blocks(q), store.offset - 1, 0.125)
    b = blockwise_attention(q, back.blocks(q), back.offset - 1, 0.125)
    assert mx.array_equal(a, b)


def test_engine_steps_pages_down_only_when_the_budget_needs_it(tiny_gemma3_dir):
    kv = KVConfig(**SMALL)
    config = dict(policy="cpu", kv=kv)
    prompt = list(range(3, 203)) * 2
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    positions = len(prompt) + sp.max_tokens
    probe = Engine(str(tiny_gemma3_dir), config=EngineConfig(**config))
    # at the smallest prefill (the chunk, the cheaper of its two ways): only stepping pages down is left
    wide, narrow = (min(probe.planner.footprint(positions, chunk=MIN_PREFILL_CHUNK, pressed=pressed, dense_prefill=dense).total
                        for dense in (False, True)) for pressed in (False, True))
    assert narrow < wide
    assert set(probe.reply(prompt, sp).stats.kv_formats) == {"q8c"}  # no budget: pages keep their format

    budget = (narrow + wide) // 2
    engine = Engine(str(tiny_gemma3_dir), budget=budget, config=EngineConfig(**config))
    offloaded, fp = engine.planner.plan(positions)
    assert offloaded == () and fp.total <= budget and fp.shape.page_row < fp.shape.top_row
    reply = engine.reply(prompt, sp)
    assert len(reply.tokens) == sp.max_tokens
    formats = reply.stats.kv_formats
    assert len(formats) >= 2 and formats.get("q8c", 0) < sum(formats.values())
    paged = engine.states.last.cache
    grown = [c.store for c in paged if isinstance(c, kvexec.PagedKVCache) and c.store.window is None]
    assert grown and all(s.page_bytes() <= s.page_limit for s in grown)
    # the planner's capacity at this budget counts the ladder's last step (both with the
    # reserve the request measured)
    way = dict(chunk=fp.shape.chunk, dense_prefill=fp.shape.dense_prefill)
    wide_cap = engine.planner.footprint(positions, **way).max_positions(budget)
    assert engine.planner.footprint(positions, pressed=True, **way).max_positions(budget) > wide_cap


def test_justfit_fit_reports_the_ladder(tiny_gemma3_dir):
    import json

    from click.testing import CliRunner

    from cli.main import main

    res = CliRunner().invoke(main, ["fit", "--model", str(tiny_gemma3_dir), "--budget", "64MiB", "--context", "300",
                                    "--kv-format", "q8c", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    rows = {row["format"]: row for row in r["formats"]}
    assert r["pressure"]["ladder"] == ["q8c", "k8cv4", "q4c", "q3c"]
    assert r["pressure"]["max_positions"] > rows["q8c"]["max_positions"]
    assert r["plan"]["fits"] and r["plan"]["pages"] == "kept in q8c"  # 300 positions need no stepping


def test_justfit_fit_shows_the_ladder_of_a_layer_that_steps_down(tiny_gemma3_dir):
    from justfit.planning.fit import fit_report

    # sliding layers in q8c, the full one (the sixth) in k8cv4, as calibration chooses
    kv = KVConfig(layer_formats=("q8c",) * 5 + ("k8cv4",))
    r = fit_report(Engine(str(tiny_gemma3_dir), config=EngineConfig(kv=kv)), 64 * 2**20)
    assert r["pressure"]["ladder"] == ["k8cv4", "q4c", "q3c"]  # the full layer's: the rings never step down
