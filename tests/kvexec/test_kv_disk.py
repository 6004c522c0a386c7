"""KV pages on disk (kvexec.disk_pages): a layer's full segments written to a page file
and read back just in time give exactly the attention, the tokens and the stored states
of pages kept in memory, at any split; the planner puts pages on disk only when the
budget needs it, before any page steps down the ladder, and refuses what the folder
cannot hold."""

from __future__ import annotations

import os
from dataclasses import replace

import mlx.core as mx
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from justfit.errors import KVDiskFull
from kvexec import KVConfig
from kvexec.cache import PagedKVCache, disk_bytes, spill_layers, trim
from kvexec.disk_pages import PageFile, PageReader, sweep
from kvexec.export import copy_layer
from tests.helpers.tiny_models import write_mlx_folder

SMALL = KVConfig(format="q8c", page_size=32, hot_window=32, block_tokens=128)


def _run(caches: list[PagedKVCache], steps: list[int], seed: int = 1) -> list[mx.array]:
    """Append keys and values in chunks of `steps` to every layer and attend after each."""
    key = mx.random.key(seed)
    outs = []
    for L in steps:
        for c in caches:
            key, a, b, q = mx.random.split(key, 4)
            k = mx.random.normal((1, 2, L, 64), key=a)
            v = mx.random.normal((1, 2, L, 64), key=b)
            c.update_and_fetch(k, v)
            outs.append(c.attend(mx.random.normal((1, 4, L, 64), key=q), 0.125))
    mx.eval(outs)
    return outs


def _layers(kv: KVConfig, n: int = 3) -> list[PagedKVCache]:
    return [PagedKVCache(kv) for _ in range(n)]


@pytest.mark.parametrize("fmt", ["q8c", "k4v4", "fp16"])
@pytest.mark.parametrize("on_disk", [1, 3])
def test_attention_over_pages_on_disk_is_bitwise_the_resident_one(tmp_path, fmt, on_disk):
    kv = replace(SMALL, format=fmt)
    steps = [37] * 9 + [1] * 40  # prefill chunks across segment edges, then decode steps
    resident = _run(_layers(kv), steps)
    caches, reader, page_file = _layers(kv), PageReader(), PageFile(tmp_path)
    assert spill_layers(caches, page_file, reader, on_disk) == on_disk
    spilled = _run(caches, steps)
    assert all(mx.array_equal(a, b).item() for a, b in zip(resident, spilled))
    assert sum(1 for c in caches if c.store.spilled()) == on_disk
    assert disk_bytes(caches) > 0 and reader.bytes_read > 0
    # what stays in memory of a disk layer is its hot window, sinks and the segment being filled
    for c in caches:
        held = sum(s.nbytes for s in c.store.segments)
        assert held <= (kv.block_tokens if c.store.spilled() else 10**9) * 2 * 2 * 64 * 2
    # two layers' reads at most at a time (the one computing, the next one read)
    reader.close()
    assert sweep(tmp_path) == 0 and os.listdir(tmp_path) == [os.path.basename(page_file.path)]  # its owner runs
    page_file.close()
    assert not os.listdir(tmp_path)  # closed, the file is gone


def test_trimming_into_pages_on_disk_then_going_on_matches_memory(tmp_path):
    steps = [37] * 9
    a = _layers(SMALL)
    b = _layers(SMALL)
    spill_layers(b, PageFile(tmp_path), PageReader(), 3)
    _run(a, steps)
    _run(b, steps)
    for n in (1, 100, 180):  # within the hot window, into the last spilled segment, past a whole one
        assert trim(a, n) and trim(b, n)
        assert [c.offset for c in a] == [c.offset for c in b]
        more_a, more_b = _run(a, [5, 1, 1], seed=n), _run(b, [5, 1, 1], seed=n)
        assert all(mx.array_equal(x, y).item() for x, y in zip(more_a, more_b))


def test_a_copy_shares_the_pages_on_disk_and_goes_its_own_way(tmp_path):
    caches = _layers(SMALL, 1)
    spill_layers(caches, PageFile(tmp_path), PageReader(), 1)
    _run(caches, [37] * 9)
    copy = [copy_layer(caches[0])]
    assert copy[0].store.spilled() == caches[0].store.spilled()  # the same extents, not read
    assert [s.nbytes for s in copy[0].store.segments] == [s.nbytes for s in caches[0].store.segments]
    mine, theirs = _run(caches, [3, 1], seed=5), _run(copy, [3, 1], seed=5)
    assert all(mx.array_equal(x, y).item() for x, y in zip(mine, theirs))
    trim(copy, 200)  # the copy reads back what it trims into; the original's pages are untouched
    again = _run([copy_layer(caches[0])], [2], seed=6)
    assert again[0].shape == (1, 4, 2, 64) and caches[0].offset == 337


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("kvdisk") / "q4", "llama", seed=9, quantize_bits=4,
                            layers=6, vocab_size=288)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return write_mlx_folder(tmp_path_factory.mktemp("kvdisk") / "gemma", "gemma3_text")


PROMPT = list(range(3, 203)) * 2  # 400 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Small segments: at 400 positions a layer's pages on disk free more than the read slots take.
ENGINE_KV = KVConfig(format="q8c", page_size=16, hot_window=16, block_tokens=32)


def _config(tmp_path, **kw) -> EngineConfig:
    return EngineConfig(policy="cpu", kv=kw.pop("kv", ENGINE_KV), prefill_chunk=16, offload_weights=False,
                        state_dir=str(tmp_path / "state"), **kw)


def _tokens(engine, prompt=PROMPT, sp=GREEDY) -> list[int]:
    return [c.token for c in engine.generate(prompt, sp) if c.token is not None]


def _tight(engine, positions: int, layers: int) -> int:
    """The footprint with `layers` growing layers on disk at the smallest prefill (the
    chunk, the cheaper of its two ways)."""
    return min(engine.planner.footprint(positions, chunk=16, dense_prefill=dense, disk_layers=layers).total
               for dense in (False, True))


def test_a_budget_that_needs_disk_gives_the_resident_tokens(q4_dir, tmp_path):
    want = _tokens(Engine(str(q4_dir), config=_config(tmp_path)))
    probe = Engine(str(q4_dir), config=_config(tmp_path, kv_disk=str(tmp_path / "kv")))
    positions = len(PROMPT) + GREEDY.max_tokens
    full_layers = probe.planner.footprint(positions).shape.full_layers
    tight = _tight(probe, positions, full_layers)
    assert tight < _tight(probe, positions, 0)  # all on disk holds less than all resident
    engine = Engine(str(q4_dir), budget=tight, config=_config(tmp_path, kv_disk=str(tmp_path / "kv")))
    offloaded, plan = engine.planner.plan(positions)
    assert plan.shape.disk_layers == full_layers and offloaded == () and plan.total <= tight
    reply = engine.reply(PROMPT, GREEDY)
    assert reply.tokens == want
    stats = reply.stats.kv_disk
    assert stats["bytes_on_disk"] > 0 and stats["bytes_read"] >= stats["bytes_on_disk"]
    # the stored state (on disk: the budget leaves the memory tier no room) resumes exactly
    again = engine.reply(PROMPT, GREEDY)
    assert again.tokens == want and again.stats.cached_tokens == len(PROMPT) - 1


def test_gemma3_with_its_full_layers_on_disk_gives_the_resident_tokens(gemma_dir, tmp_path):
    kv = KVConfig(format="q8c", page_size=32, hot_window=32, block_tokens=64)
    want = _tokens(Engine(str(gemma_dir), config=_config(tmp_path, kv=kv)))
    engine = Engine(str(gemma_dir), config=_config(tmp_path, kv=kv, kv_disk=str(tmp_path / "kv"),
                                                   kv_disk_layers=99))
    reply = engine.reply(PROMPT, GREEDY)
    assert reply.tokens == want and reply.stats.kv_disk["bytes_on_disk"] > 0


def test_the_planner_moves_pages_to_disk_only_as_the_budget_needs(q4_dir, tmp_path):
    positions = len(PROMPT) + GREEDY.max_tokens
    probe = Engine(str(q4_dir), config=_config(tmp_path, kv_disk=str(tmp_path / "kv")))
    layers = probe.planner.footprint(positions).shape.full_layers
    totals = [_tight(probe, positions, n) for n in range(layers + 1)]
    chosen = []
    for budget in sorted({totals[0] * 4, *totals}, reverse=True):
        engine = Engine(str(q4_dir), budget=budget, config=_config(tmp_path, kv_disk=str(tmp_path / "kv")))
        _, plan = engine.planner.plan(positions)
        assert plan.total <= budget
        chosen.append(plan.shape.disk_layers)
    # the fewest layers on disk that fit: none while the budget is roomy, more as it tightens
    assert chosen[0] == 0 and chosen == sorted(chosen) and chosen[-1] == layers
    # without a folder, the same tight budget steps pages down the ladder instead
    ladder = Engine(str(q4_dir), budget=min(totals),
                    config=_config(tmp_path, kv=replace(ENGINE_KV, pressure=("q4c",))))
    assert ladder.planner.plan(positions)[1].shape.disk_layers == 0


def test_pages_past_the_folders_room_are_refused_before_any_work(q4_dir, tmp_path):
    engine = Engine(str(q4_dir), config=_config(tmp_path, kv_disk=str(tmp_path / "kv"), kv_disk_layers=6,
                                                 kv_disk_limit=4096))
    streamed = []
    with pytest.raises(KVDiskFull, match=r"positions need .* of pages on disk > 4(\.0+)? KiB allowed"):
        streamed.extend(engine.generate(PROMPT, GREEDY))
    assert streamed == [] and engine.states.last is None  # nothing streamed, nothing computed or stored


def test_smollm2_with_its_pages_on_disk_replies_as_with_them_in_memory(smollm2_gguf, tmp_path):
    from bench.common import long_text

    base = EngineConfig(kv=KVConfig(format="calibrated"), state_dir=str(tmp_path / "state"))
    resident = Engine(str(smollm2_gguf), config=base)
    prompt = resident.tokenizer.encode(long_text()[:9000])[:2400]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _tokens(resident, prompt, sp)
    on_disk = Engine(str(smollm2_gguf), config=replace(base, kv_disk=str(tmp_path / "kv"), kv_disk_layers=30))
    reply = on_disk.reply(prompt, sp)
    assert reply.tokens == want and reply.stats.kv_disk["bytes_on_disk"] > 0


def test_fit_shows_the_layers_on_disk_and_what_a_token_reads(q4_dir, tmp_path):
    from justfit.planning.fit import fit_report, format_fit

    engine = Engine(str(q4_dir), config=_config(tmp_path, kv_disk=str(tmp_path / "kv")))
    positions = len(PROMPT) + GREEDY.max_tokens
    layers = engine.planner.footprint(positions).shape.full_layers
    report = fit_report(engine, _tight(engine, positions, layers), positions)
    plan = report["plan"]["kv_layers"]
    assert plan["on_disk"] == layers and plan["resident"] == 0 and plan["read_per_token"] > 0
    assert report["kv_disk"]["max_positions"] > report["formats"][0]["max_positions"]
    text = format_fit(report)
    assert f"KV pages of {layers} layers on disk" in text and "read back every decoded token" in text
