"""One disk format for live pages and stored states: a state whose pages are on disk is
stored by linking its page file into the snapshot (the manifest names each part's place
and sha256), never by writing the pages again; it loads with those segments still on
disk, exactly; a damaged, truncated, swapped or forged page file is refused as damage;
where no link can be made (another file system) the pages are copied as before; the
page file a killed owner left is swept, a live owner's never."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
from pathlib import Path

import pytest

from justfit import runtime

runtime.setup()

import mlx.core as mx  # noqa: E402

import statetrans.snapshot as snapshot_mod  # noqa: E402
from justfit import Engine, SamplingParams  # noqa: E402
from justfit.config import EngineConfig  # noqa: E402
from kvexec import KVConfig  # noqa: E402
from kvexec.cache import PagedKVCache, disk_bytes, spill_layers  # noqa: E402
from kvexec.disk_pages import PREFIX, SUFFIX, PageFile, PageReader, sweep  # noqa: E402
from statetrans import capture, load_snapshot, rebuild, save_snapshot  # noqa: E402
from statetrans.snapshot import SnapshotError  # noqa: E402

KV = KVConfig(format="q8c", page_size=32, hot_window=32, block_tokens=64)


def _filled(folder: Path, seed: int = 3) -> list[PagedKVCache]:
    """Three layers, every one on disk, 300 positions each."""
    caches = [PagedKVCache(KV) for _ in range(3)]
    spill_layers(caches, PageFile(folder), PageReader(), 3)
    key = mx.random.key(seed)
    for _ in range(10):  # in chunks, each attended to (a full segment spills once attention has read it)
        for c in caches:
            key, a, b, q = mx.random.split(key, 4)
            c.update_and_fetch(mx.random.normal((1, 2, 30, 64), key=a), mx.random.normal((1, 2, 30, 64), key=b))
            mx.eval(c.attend(mx.random.normal((1, 4, 30, 64), key=q), 0.125))
    return caches


def _attend(caches: list[PagedKVCache]) -> list[mx.array]:
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(9))
    out = [c.attend(q, 0.125) for c in caches]
    mx.eval(out)
    return out


def _saved(tmp_path: Path) -> tuple[list[PagedKVCache], Path]:
    caches = _filled(tmp_path / "kv")
    assert disk_bytes(caches) > 0
    arrays, layers = capture(caches, lazy=True)
    path = tmp_path / "snap"
    save_snapshot(path, arrays, {"tokens": [1] * 300, "layers": layers})
    return caches, path


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_pages_on_disk_are_linked_not_written_again_and_load_exactly(tmp_path):
    caches, path = _saved(tmp_path)
    (pages,) = path.glob("pages-*.bin")
    live = caches[0].store.page_file
    assert os.stat(pages).st_ino == os.fstat(live.fd).st_ino  # the same file, linked
    parts = _manifest(path)["pages"][pages.name]
    assert not set(parts) & set(json.loads(_header(path)))  # none of them in the arrays file
    sizes = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "U32": 4}
    assert sum(math.prod(p["shape"]) * sizes[p["dtype"]] for p in parts.values()) == disk_bytes(caches)
    arrays, manifest = load_snapshot(path)
    restored = rebuild(arrays, manifest["layers"])
    # the restored segments are on disk where the snapshot links them, read as attention needs them
    assert all(s.extent is not None and s.extent.file.path == str(pages)
               for c in restored for s in c.store.segments if s.length == s.capacity)
    assert all(mx.array_equal(a, b).item() for a, b in zip(_attend(caches), _attend(restored)))
    # the live file may go: the snapshot's link keeps the pages
    live.close()
    assert not list((tmp_path / "kv").iterdir())
    again = rebuild(*(lambda a, m: (a, m["layers"]))(*load_snapshot(path)))
    assert all(mx.array_equal(a, b).item() for a, b in zip(_attend(restored), _attend(again)))


def test_a_snapshot_of_a_restored_state_links_the_same_pages(tmp_path):
    caches, path = _saved(tmp_path)
    arrays, manifest = load_snapshot(path)
    restored = rebuild(arrays, manifest["layers"])
    arrays2, layers2 = capture(restored, lazy=True)
    save_snapshot(tmp_path / "snap2", arrays2, {"tokens": [1] * 300, "layers": layers2})
    (first,), (second,) = path.glob("pages-*.bin"), (tmp_path / "snap2").glob("pages-*.bin")
    assert os.stat(first).st_ino == os.stat(second).st_ino
    # replacing a snapshot in place keeps exactly the files its new manifest names
    save_snapshot(path, arrays2, {"tokens": [1] * 300, "layers": layers2})
    names = {p.name for p in path.iterdir()}
    assert names == {"manifest.json", *_manifest(path)["files"], *_manifest(path)["pages"]}


def test_where_no_link_can_be_made_the_pages_are_copied(tmp_path, monkeypatch):
    def cross_device(*_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(snapshot_mod.os, "link", cross_device)
    caches, path = _saved(tmp_path)
    assert not list(path.glob("pages-*.bin")) and "pages" not in _manifest(path)
    arrays, manifest = load_snapshot(path)
    restored = rebuild(arrays, manifest["layers"])
    assert all(mx.array_equal(a, b).item() for a, b in zip(_attend(caches), _attend(restored)))


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_damaged_or_forged_page_file_is_refused_as_damage(tmp_path):
    caches, path = _saved(tmp_path)
    (pages,) = path.glob("pages-*.bin")
    parts = _manifest(path)["pages"][pages.name]
    first = min(p["offset"] for p in parts.values())
    _flip(pages, first)  # (the live file is the same inode: the caches are not used again)
    with pytest.raises(SnapshotError, match="checksum mismatch") as e:
        load_snapshot(path)
    assert e.value.damaged
    _flip(pages, first)
    load_snapshot(path)  # whole again
    # truncated
    size = pages.stat().st_size
    os.truncate(pages, first + 1)
    with pytest.raises(SnapshotError, match="truncated") as e:
        load_snapshot(path)
    assert e.value.damaged


@pytest.mark.parametrize("forge", ["outside", "traversal", "symlink", "overlap", "twice"])
def test_a_forged_manifest_cannot_reach_outside_its_snapshot(tmp_path, forge):
    _, path = _saved(tmp_path)
    manifest = _manifest(path)
    (name, parts), = manifest["pages"].items()
    key = next(iter(parts))
    if forge == "outside":
        parts[key]["offset"] = 2**40
    elif forge == "traversal":
        manifest["pages"] = {"../kv/" + name: parts}
    elif forge == "overlap":
        other = list(parts)[1]
        parts[other]["offset"] = parts[key]["offset"]
    elif forge == "twice":  # a part also given in the arrays file
        parts[next(k for k in json.loads(_header(path)) if k != "__metadata__")] = parts.pop(key)
    else:  # the page file swapped for a link to the live one
        target = next((tmp_path / "kv").glob(f"{PREFIX}*{SUFFIX}"))
        (path / name).unlink()
        (path / name).symlink_to(target)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError) as e:
        load_snapshot(path)
    assert e.value.damaged


def _header(path: Path) -> str:
    data = next(path.glob("arrays*.safetensors")).read_bytes()
    n = int.from_bytes(data[:8], "little")
    return data[8:8 + n].decode()


def test_sweep_removes_only_page_files_whose_owner_is_gone(tmp_path):
    live = PageFile(tmp_path)
    orphan = tmp_path / f"{PREFIX}orphan{SUFFIX}"  # as a killed owner leaves it: named, no lock held
    orphan.write_bytes(b"x" * 4096)
    other = tmp_path / "notes.txt"
    other.write_text("not a page file")
    assert sweep(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(live.path), "notes.txt"])
    # another holder's lock (as another process's) keeps a file too
    held = tmp_path / f"{PREFIX}held{SUFFIX}"
    held.write_bytes(b"")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert sweep(tmp_path) == 0
    finally:
        os.close(fd)
    assert sweep(tmp_path) == 1
    live.close()
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_a_session_on_disk_resumes_after_a_restart_from_its_linked_pages(tiny_llama_dir, tmp_path):
    kv = KVConfig(format="q8c", page_size=16, hot_window=16, block_tokens=32)

    def config(state: Path, **kw) -> EngineConfig:
        return EngineConfig(policy="cpu", kv=kv, prefill_chunk=16, offload_weights=False, state_dir=str(state),
                            **kw)

    disk = config(tmp_path / "state", kv_disk=str(tmp_path / "kv"), kv_disk_layers=99, state_memory=0)
    prompt = list(range(3, 203)) * 2
    engine = Engine(str(tiny_llama_dir), config=disk)
    engine.reply(prompt, GREEDY, session="s")
    engine.flush_sessions()
    turn1 = engine.cached_tokens
    (_, g1), = engine.states.store.generations("s")
    (pages,) = g1.glob("pages-*.bin")
    inode = os.stat(pages).st_ino
    del engine
    follow = turn1 + list(range(40, 60))
    again = Engine(str(tiny_llama_dir), config=disk)  # a restart: the page file's old name is swept
    got = again.reply(follow, GREEDY, session="s")
    cold = Engine(str(tiny_llama_dir), config=config(tmp_path / "cold")).reply(follow, GREEDY)
    assert got.tokens == cold.tokens
    assert got.stats.restored_from == "disk" and got.stats.cached_tokens == len(turn1)
    again.flush_sessions()
    (_, g2), = again.states.store.generations("s")
    assert inode in {os.stat(p).st_ino for p in g2.glob("pages-*.bin")}  # turn 1's pages linked, not copied
