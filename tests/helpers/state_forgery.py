"""Damaged and forged copies of a healthy state directory: what a disk, a crash or a
forger who knows the format can leave there, for tests that whatever a state directory
holds, StateTiers (or a server) starts, answers and quarantines the bad part.

`variants(healthy, scratch, n)` copies a healthy state directory (as a tiny model's
engine writes it) to `scratch` n times, each time with one snapshot damaged by one of
KINDS: random truncations and bit flips (checksums left as they are), and edits made
with the checksums and the manifest digest recomputed (extra or absurd state paths,
Infinity, huge integers, deep nesting, wrong layer counts, shapes that do not match,
tokens out of vocabulary, a 100 MiB manifest, links, a FIFO, ...). Every variant is
one a reader must refuse; `Variant.target` says which snapshot was hit.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
HUGE = 100 << 20  # bytes of the oversized manifest


@dataclass(frozen=True)
class Target:
    """A snapshot in a state directory: its folder relative to the directory, whether it
    is a session's generation, and the kinds of its layers ("paged", "mlx-lm")."""

    rel: Path
    session: bool
    kinds: frozenset[str]

    @property
    def model(self) -> str:
        """The model folder (identity key) it is in."""
        return self.rel.parts[0]


@dataclass(frozen=True)
class Variant:
    """One damaged copy: what was done, to which snapshot."""

    kind: str
    target: Target


def snapshots(state_dir: Path) -> list[Target]:
    """The snapshots a healthy state directory holds: each session's newest generation
    and every anonymous state."""
    out = []
    for model in sorted(p for p in state_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for folder in sorted((model / "sessions").glob("*")):
            gens = sorted(g for g in folder.glob("g*") if g.is_dir())
            if gens:
                out.append(_target(state_dir, gens[-1], True))
        out += [_target(state_dir, p, False) for p in sorted((model / "anon").glob("*")) if not p.name.startswith(".")]
    return out


def _target(state_dir: Path, path: Path, session: bool) -> Target:
    m = json.loads((path / MANIFEST).read_text())
    return Target(path.relative_to(state_dir), session, frozenset(layer["kind"] for layer in m["layers"]))


# -- reading and writing a snapshot as a forger would ---------------------------------
def _arrays_name(folder: Path) -> str:
    return next(iter(json.loads((folder / MANIFEST).read_text())["files"]))


def read_arrays(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header (as parsed JSON) and data region."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_arrays(path: Path, header: dict, data: bytes) -> None:
    """A safetensors file from a header and a data region (padded as MLX pads)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def digest(manifest: dict) -> str:
    """What the arrays file carries of a manifest (statetrans.snapshot's digest)."""
    core = {k: v for k, v in manifest.items() if k != "files"}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def forge(folder: Path, manifest: dict, header: dict | None = None, data: bytes | None = None,
          text: Callable[[str], str] | None = None) -> None:
    """Write `manifest` (and the arrays file's `header`/`data`, default as they are) into
    snapshot `folder` with every checksum a forger can recompute: the digest in the
    arrays file and the file's size and sha256 in the manifest. `text` edits the
    manifest's JSON text last (what no parser round-trips: deep nesting, duplicate keys)."""
    name = _arrays_name(folder)
    old_header, old_data = read_arrays(folder / name)
    header = copy.deepcopy(old_header if header is None else header)
    with _unlimited_ints():
        try:
            header.setdefault("__metadata__", {})["manifest_sha256"] = digest(manifest)
        except (ValueError, RecursionError):  # not JSON Python writes: the old digest stays
            pass
        write_arrays(folder / name, header, old_data if data is None else data)
        raw = (folder / name).read_bytes()
        files = {name: {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}}
        out = json.dumps({**manifest, "files": files}, separators=(",", ":"))
    (folder / MANIFEST).write_text(text(out) if text is not None else out)


class _unlimited_ints:
    """Python refuses to print integers of more than 4,300 digits; a forger does not."""

    def __enter__(self):
        self.limit = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)

    def __exit__(self, *exc):
        sys.set_int_max_str_digits(self.limit)


# -- the damage ---------------------------------------------------------------------
def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def _layer(m: dict, kind: str) -> dict:
    return next(layer for layer in m["layers"] if layer["kind"] == kind)


def _edit(change: Callable[[dict, random.Random, int | None], None]) -> Callable:
    """A damage that edits the manifest object and re-signs it."""
    def run(folder: Path, rng: random.Random, vocab: int | None) -> None:
        m = _manifest(folder)
        change(m, rng, vocab)
        forge(folder, m)
    return run


def _edit_text(change: Callable[[str], str]) -> Callable:
    """A damage that edits the manifest's text (after re-signing what parses)."""
    def run(folder: Path, rng: random.Random, vocab: int | None) -> None:
        forge(folder, _manifest(folder), text=change)
    return run


def _truncate(name: Callable[[Path], str]) -> Callable:
    def run(folder: Path, rng: random.Random, vocab: int | None) -> None:
        path = folder / name(folder)
        raw = path.read_bytes()
        path.write_bytes(raw[:rng.randrange(len(raw))])
    return run


def _flip(name: Callable[[Path], str], flips: tuple[int, ...] = (1, 1, 2, 8)) -> Callable:
    def run(folder: Path, rng: random.Random, vocab: int | None) -> None:
        path = folder / name(folder)
        original = path.read_bytes()
        while True:
            buf = bytearray(original)
            for _ in range(rng.choice(flips)):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            if name(folder) != MANIFEST or not _same_json(bytes(buf), original):
                break  # (a manifest flip that still says the same, e.g. e -> E, is no damage)
        path.write_bytes(bytes(buf))
    return run


def _same_json(a: bytes, b: bytes) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def _add_path(path: str) -> Callable:
    def change(m: dict, rng: random.Random, vocab: int | None) -> None:
        layer = _layer(m, "mlx-lm")
        layer["paths"].append(path)
        layer["scalars"][path] = 0
    return _edit(change)


def _many_paths(m: dict, rng: random.Random, vocab: int | None) -> None:
    layer = _layer(m, "mlx-lm")
    extra = [f"{i}" for i in range(3, 10_003)]
    layer["paths"] += extra
    layer["scalars"].update({p: 0 for p in extra})


def _set(getter: Callable[[dict], dict], key, value) -> Callable:
    def change(m: dict, rng: random.Random, vocab: int | None) -> None:
        getter(m)[key] = copy.deepcopy(value)
    return _edit(change)


def _token(value) -> Callable:
    def change(m: dict, rng: random.Random, vocab: int | None) -> None:
        m["tokens"][rng.randrange(len(m["tokens"]))] = (vocab if vocab is not None else 2**31) + 3 \
            if value == "vocab" else value
    return _edit(change)


def _reshape(folder: Path, rng: random.Random, vocab: int | None) -> None:
    """One array's shape in the header changed, its byte count kept: only the layout lies."""
    name = _arrays_name(folder)
    header, data = read_arrays(folder / name)
    candidates = [k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) >= 2
                  and v["shape"][-1] != v["shape"][-2]]
    k = rng.choice(candidates)
    shape = header[k]["shape"]
    header[k]["shape"] = shape[:-2] + [shape[-1], shape[-2]]
    forge(folder, _manifest(folder), header, data)


def _retype(folder: Path, rng: random.Random, vocab: int | None) -> None:
    """A float16 array declared int16 (same bytes)."""
    name = _arrays_name(folder)
    header, data = read_arrays(folder / name)
    floats = [k for k, v in header.items() if k != "__metadata__" and v["dtype"] in ("F16", "BF16")]
    if not floats:  # float32 arrays: declared int32
        floats = [k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32"]
    k = rng.choice(floats)
    header[k]["dtype"] = {"F16": "I16", "BF16": "I16", "F32": "I32"}[header[k]["dtype"]]
    forge(folder, _manifest(folder), header, data)


def _aliases(folder: Path, rng: random.Random, vocab: int | None) -> None:
    """10,000 more arrays all reading the same bytes: loading them would allocate
    10,000 times the file."""
    name = _arrays_name(folder)
    header, data = read_arrays(folder / name)
    k, v = max(((k, v) for k, v in header.items() if k != "__metadata__"),
               key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    header.update({f"{k}.alias{i}": v for i in range(10_000)})
    forge(folder, _manifest(folder), header, data)


def _outside(folder: Path, rng: random.Random, vocab: int | None) -> None:
    """An array whose data lies past the end of the file (a 4 GiB one)."""
    name = _arrays_name(folder)
    header, data = read_arrays(folder / name)
    header["layer0.huge"] = {"dtype": "F32", "shape": [1 << 30], "data_offsets": [len(data), len(data) + (4 << 30)]}
    forge(folder, _manifest(folder), header, data)


def _huge_manifest(folder: Path, rng: random.Random, vocab: int | None) -> None:
    """A 100 MiB manifest (sparse: its JSON, then zeros)."""
    with open(folder / MANIFEST, "r+b") as f:
        f.truncate(HUGE)


def _link(name: Callable[[Path], str], to: str) -> Callable:
    def run(folder: Path, rng: random.Random, vocab: int | None) -> None:
        path = folder / name(folder)
        path.unlink()
        path.symlink_to(to)
    return run


def _fifo_manifest(folder: Path, rng: random.Random, vocab: int | None) -> None:
    (folder / MANIFEST).unlink()
    os.mkfifo(folder / MANIFEST)


def _folder_link(folder: Path, rng: random.Random, vocab: int | None) -> None:
    """The snapshot folder replaced by a link (to a sibling, else to the root)."""
    siblings = [p for p in folder.parent.iterdir() if p != folder and p.is_dir() and not p.name.startswith(".")]
    shutil.rmtree(folder)
    folder.symlink_to(siblings[0].name if siblings else "/")


def _manifest_dir(folder: Path, rng: random.Random, vocab: int | None) -> None:
    (folder / MANIFEST).unlink()
    (folder / MANIFEST).mkdir()


def _deep(text: str) -> str:
    depth = 100_000
    return text[:-1] + ',"extra":' + "[" * depth + "]" * depth + "}"


def _duplicate_tokens(text: str) -> str:
    return text[:-1] + ',"tokens":[1,2,3]}'


def _nan_score(text: str) -> str:
    return text.replace('"score":0.0', '"score":NaN', 1) if '"score":0.0' in text else text.replace(
        '"tokens":[', '"tokens":[NaN,', 1)


def _fewer_layers(m: dict, rng: random.Random, vocab: int | None) -> None:
    m["layers"].pop()


def _more_layers(m: dict, rng: random.Random, vocab: int | None) -> None:
    m["layers"].append(copy.deepcopy(m["layers"][0]))


def _shorter_tokens(m: dict, rng: random.Random, vocab: int | None) -> None:
    m["tokens"].pop()


def _many_segments(m: dict, rng: random.Random, vocab: int | None) -> None:
    layer = _layer(m, "paged")
    layer["segments"] = [copy.deepcopy(layer["segments"][0]) for _ in range(2_000)] if layer["segments"] else \
        [{"start": 0, "capacity": 16, "length": 16, "score": 0.0, "keys": ["x"], "values": ["x"], "format": "fp16"}] * 2_000


def _huge_capacity(m: dict, rng: random.Random, vocab: int | None) -> None:
    layer = _layer(m, "paged")
    if layer["segments"]:
        layer["segments"][0]["capacity"] = 1 << 30
    else:
        layer["offset"] = 1 << 30


def _hot_window(m: dict, rng: random.Random, vocab: int | None) -> None:
    _layer(m, "paged")["config"]["hot_window"] = 1 << 30


def _kv_edit(m: dict, rng: random.Random, vocab: int | None) -> None:
    if isinstance(m.get("kv"), dict):
        m["kv"]["page_size"] = 1
    else:
        m["kv"] = {"format": "q8c"}


def _other_session(m: dict, rng: random.Random, vocab: int | None) -> None:
    m["session"] = "someone else"


def _offset_scalar(value) -> Callable:
    def change(m: dict, rng: random.Random, vocab: int | None) -> None:
        layer = _layer(m, "mlx-lm")
        layer["scalars"][sorted(layer["scalars"])[-1]] = value
    return change


ANY, PAGED, MLX = "any", "paged", "mlx-lm"

# kind -> (what it applies to, the damage); every one must be refused.
KINDS: dict[str, tuple[str, Callable[[Path, random.Random, int | None], None]]] = {
    "truncate arrays": (ANY, _truncate(_arrays_name)),
    "truncate manifest": (ANY, _truncate(lambda f: MANIFEST)),
    "flip arrays": (ANY, _flip(_arrays_name)),
    "flip manifest": (ANY, _flip(lambda f: MANIFEST, (1,))),
    "empty manifest": (ANY, lambda f, r, v: (f / MANIFEST).write_bytes(b"")),
    "no arrays file": (ANY, lambda f, r, v: (f / _arrays_name(f)).unlink()),
    "path 3000000": (MLX, _add_path("3000000")),
    "path of 5,000 dots": (MLX, _add_path("a" + ".a" * 5000)),
    "path with a big index": (MLX, _add_path("0.99")),
    "10,000 paths": (MLX, _edit(_many_paths)),
    "unknown cache class": (MLX, _set(lambda m: _layer(m, MLX), "class", "CacheList")),
    "module function as class": (MLX, _set(lambda m: _layer(m, MLX), "class", "make_prompt_cache")),
    "huge scalar": (MLX, _edit(_offset_scalar(10**30))),
    "string scalar": (MLX, _edit(_offset_scalar("83"))),
    "token Infinity": (ANY, _token(float("inf"))),
    "token of 5,000 digits": (ANY, _token(10**5000)),
    "token out of vocabulary": (ANY, _token("vocab")),
    "token 2**31": (ANY, _token(2**31)),
    "negative token": (ANY, _token(-1)),
    "boolean token": (ANY, _token(True)),
    "fractional token": (ANY, _token(1.5)),
    "100,000-deep nesting": (ANY, _edit_text(_deep)),
    "duplicate key": (ANY, _edit_text(_duplicate_tokens)),
    "NaN": (ANY, _edit_text(_nan_score)),
    "a layer fewer": (ANY, _edit(_fewer_layers)),
    "a layer more": (ANY, _edit(_more_layers)),
    "tokens and positions disagree": (ANY, _edit(_shorter_tokens)),
    "shape transposed": (ANY, _reshape),
    "dtype declared int": (ANY, _retype),
    "10,000 aliased arrays": (ANY, _aliases),
    "array past the end": (ANY, _outside),
    "2,000 segments": (PAGED, _edit(_many_segments)),
    "segment capacity 2**30": (PAGED, _edit(_huge_capacity)),
    "hot window 2**30": (PAGED, _edit(_hot_window)),
    "KV settings edited": (ANY, _edit(_kv_edit)),
    "sampler forged": (ANY, _set(lambda m: m, "sampler", {"seed": "x", "step": -1})),
    "owner forged": (ANY, _set(lambda m: m, "owner", {"pid": -5, "started": "now"})),
    "files forged": (ANY, lambda f, r, v: (f / MANIFEST).write_text(json.dumps(
        {**_manifest(f), "files": {"../../etc/passwd": {"sha256": "0" * 64, "bytes": 1}}}))),
    "not an object": (ANY, lambda f, r, v: (f / MANIFEST).write_text("[]")),
    "100 MiB manifest": (ANY, _huge_manifest),
    "manifest links to /dev/zero": (ANY, _link(lambda f: MANIFEST, "/dev/zero")),
    "arrays link to /dev/urandom": (ANY, _link(_arrays_name, "/dev/urandom")),
    "manifest is a FIFO": (ANY, _fifo_manifest),
    "manifest is a folder": (ANY, _manifest_dir),
    "snapshot folder is a link": (ANY, _folder_link),
}
SESSION_ONLY = {"generation of another session": _edit(_other_session)}


def damage(state_dir: Path, target: Target, kind: str, rng: random.Random, vocab: int | None = None) -> None:
    """Apply damage `kind` to snapshot `target` of `state_dir`, in place."""
    fn = SESSION_ONLY[kind] if kind in SESSION_ONLY else KINDS[kind][1]
    fn(state_dir / target.rel, rng, vocab)


def applies(kind: str, target: Target) -> bool:
    """Whether damage `kind` can be done to `target` (some need a kind of layer, or a session)."""
    if kind in SESSION_ONLY:
        return target.session
    needs = KINDS[kind][0]
    return needs == ANY or needs in target.kinds


def variants(healthy: Path, scratch: Path, count: int, seed: int = 0, vocab: int | None = None,
             kinds: list[str] | None = None) -> Iterator[Variant]:
    """`count` damaged copies of state directory `healthy`, one at a time at `scratch`
    (replaced by the next): every kind once first, then kinds at random, on a snapshot
    at random among those the kind applies to."""
    rng = random.Random(seed)
    targets = snapshots(healthy)
    names = kinds or [*KINDS, *SESSION_ONLY]
    for i in range(count):
        kind = names[i] if i < len(names) else rng.choice(names)
        fitting = [t for t in targets if applies(kind, t)]
        if not fitting:
            continue
        target = rng.choice(fitting)
        if scratch.exists() or scratch.is_symlink():
            _clear(scratch)
        shutil.copytree(healthy, scratch, symlinks=True)
        damage(scratch, target, kind, rng, vocab)
        yield Variant(kind, target)


def _clear(path: Path) -> None:
    """Remove a damaged copy (FIFOs, links and folders included)."""
    shutil.rmtree(path)
