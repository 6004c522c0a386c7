"""The snapshot reader under damage: 1,000 random truncations, bit flips and manifest
edits of a real snapshot; every one refused with a SnapshotError (never accepted,
never another exception), and a manifest without checksums refused with a reason."""

from __future__ import annotations

import copy
import json
import random
import shutil
from collections import Counter

import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from kvexec import KVConfig
from statetrans import SnapshotError

CASES = 1000
VALUES = [None, "", "x", -1, 0, 1, 2**70, 1.5, [], {}, [1, 2], {"a": 1}, True, "arrays.safetensors",
          "../arrays.safetensors", "0" * 64]


@pytest.fixture(scope="module")
def snapshot(tiny_llama_dir, tmp_path_factory):
    kv = KVConfig(format="fp16", page_size=16, hot_window=16, block_tokens=64)
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(kv=kv, prefill_chunk=16))
    list(engine.generate(list(range(70, 110)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    path = tmp_path_factory.mktemp("fuzz") / "snap"
    engine.save_state(str(path))
    engine.states.read(path)  # the intact snapshot is accepted
    return engine, path


def _paths(tree, prefix=()):
    """Every (path of keys/indices) inside a JSON tree."""
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:8]):
            yield from _paths(v, prefix + (i,))


def _edit(manifest: dict, rng: random.Random) -> dict:
    """The manifest with one random structural edit: a value replaced, a key removed
    or added."""
    out = copy.deepcopy(manifest)
    path = rng.choice([p for p in _paths(out) if p])
    parent = out
    for k in path[:-1]:
        parent = parent[k]
    action = rng.random()
    if action < 0.25 and isinstance(parent, dict):
        del parent[path[-1]]
    elif action < 0.35 and isinstance(parent, dict):
        parent[f"extra{rng.randrange(9)}"] = rng.choice(VALUES)
    else:
        parent[path[-1]] = rng.choice(VALUES + [rng.randrange(-5, 10**6)])
    return out


def test_damaged_snapshots_are_all_refused_with_a_snapshot_error(snapshot, tmp_path):
    engine, original = snapshot
    data = (original / "arrays.safetensors").read_bytes()
    text = (original / "manifest.json").read_text()
    manifest = json.loads(text)
    rng = random.Random(1234)
    target = tmp_path / "case"
    shutil.copytree(original, target)
    outcomes, kinds = Counter(), Counter()
    tried = 0
    while tried < CASES:
        kind = rng.choice(["truncate arrays", "truncate manifest", "flip arrays", "flip manifest", "edit manifest"])
        arrays, mtext = data, text
        if kind == "truncate arrays":
            arrays = data[: rng.randrange(len(data))]
        elif kind == "truncate manifest":
            mtext = text[: rng.randrange(len(text))]
        elif kind == "flip arrays":
            buf = bytearray(data)
            for _ in range(rng.choice([1, 1, 2, 8])):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            arrays = bytes(buf)
        elif kind == "flip manifest":
            buf = bytearray(text.encode())
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            mtext = buf.decode("utf-8", "surrogateescape")
        else:
            mtext = json.dumps(_edit(manifest, rng))
        try:
            if json.loads(mtext) == manifest and arrays == data:
                continue  # the same snapshot (e.g. 1e-05 flipped to 1E-05): not damage
        except ValueError:
            pass
        tried += 1
        kinds[kind] += 1
        (target / "arrays.safetensors").write_bytes(arrays)
        (target / "manifest.json").write_bytes(mtext.encode("utf-8", "surrogateescape"))
        try:
            engine.states.read(target)
            outcomes["accepted"] += 1
        except SnapshotError:
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 - counted: the test demands none
            outcomes[f"{type(e).__name__}: {e}"] += 1
    print(f"fuzz: {dict(kinds)} -> {dict(outcomes)}")
    assert outcomes == Counter(refused=CASES)


def test_a_manifest_without_checksums_is_refused_with_the_reason(snapshot, tmp_path):
    engine, original = snapshot
    target = tmp_path / "nofiles"
    shutil.copytree(original, target)
    manifest = json.loads((target / "manifest.json").read_text())
    del manifest["files"]
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match="no checksums"):
        engine.states.read(target)
    manifest["files"] = {"../../etc/passwd": {"sha256": "0" * 64, "bytes": 1}}
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match="unexpected file"):
        engine.states.read(target)
