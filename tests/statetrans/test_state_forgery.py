"""Whatever a state directory holds, stored states start, answer and recover: damaged
or forged copies of a healthy directory (tests/helpers/state_forgery.py: truncations, bit
flips, edits with recomputed checksums, huge and deep values, links; 100 by default,
1,000 with --long) never stop StateTiers from starting nor a request naming the
damaged session from being answered (from the previous generation, or cold); the bad
snapshot ends in quarantine, and scanning damaged files costs no more memory than a
clean start. Also: temporaries and states of another process with this one's PID (a
container sharing the volume) are not taken for this one's, and `justfit state`
lists, removes and verifies odd names and a quarantine."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from statetrans.disk import OWNERS, Owner, mine, owner_alive, owner_live, sweep_temporaries, temp_name, temp_tag
from statetrans.quarantine import QUARANTINE, quarantined
from statetrans.state import holds
from statetrans.tiers import StateTiers
from tests.helpers.state_engines import SMALL_PAGES, run_tokens, words
from tests.helpers.state_forgery import KINDS, SESSION_ONLY, Variant, applies, damage, snapshots, variants

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 267  # tests/helpers/tiny_models.py's


@dataclass
class Model:
    """One model folder of the healthy directory: what opens it and what it holds."""

    identity: dict
    layers: int
    turn1: list[int]  # session "s", generation 1 (kept, as if cleanup had not run yet)
    turn2: list[int]  # its generation 2, the newest
    anon: list[int]  # the one anonymous state


@pytest.fixture(scope="module")
def healthy(tiny_llama_dir, tmp_path_factory) -> tuple[Path, dict[str, Model]]:
    """A state directory with two model folders (paged KV, mlx-lm's caches), each with
    a session of two generations and one anonymous state."""
    state = tmp_path_factory.mktemp("forgery") / "state"
    models = {}
    for kv in (SMALL_PAGES, None):
        engine = Engine(str(tiny_llama_dir), config=EngineConfig(kv=kv, prefill_chunk=16, state_dir=str(state)))
        run_tokens(engine, words(24, 1), GREEDY, session="s")
        engine.flush_sessions()
        turn1 = list(engine.states.index.session("s").tokens)
        (_, g1), = engine.states.store.generations("s")
        shutil.copytree(g1, state / "g1")
        run_tokens(engine, turn1 + words(8, 2), GREEDY, session="s")
        engine.flush_sessions()
        turn2 = list(engine.states.index.session("s").tokens)
        os.rename(state / "g1", g1)
        engine.reset()  # the turn-1 checkpoint goes: one anonymous state, of its own tokens
        run_tokens(engine, [250] + words(30, 3), GREEDY)
        anon = list(engine.states.last.tokens)
        engine.states.fit(0)  # on disk
        s = engine.states
        models[s.dir.name] = Model(s.identity, s.layers, turn1, turn2, anon)
    return state, models


def _tiers(state: Path, m: Model) -> StateTiers:
    return StateTiers(state, m.identity, m.layers, 1 << 30, 1 << 40, vocab=VOCAB)


def _in_quarantine(model_dir: Path, rel: Path) -> bool:
    return any(q.source == str(rel) for q in quarantined(model_dir))


def test_a_damaged_or_forged_state_never_stops_a_start_or_a_request(healthy, tmp_path, request):
    state, models = healthy
    count = 1000 if request.config.getoption("--long") else 100
    scratch = tmp_path / "state"
    kinds: Counter = Counter()
    start = time.perf_counter()
    for v in variants(state, scratch, count, seed=49, vocab=VOCAB):
        kinds[v.kind] += 1
        hit = models[v.target.model]
        for key, m in models.items():
            tiers = _tiers(scratch, m)  # never raises, whatever the directory holds
            first = tiers.take(m.turn2 + [5], session="s")
            if key == v.target.model and v.target.session:
                # The damaged newest generation is never used: the previous one serves
                # (at once, or from the next request on, once the failed load found it).
                assert first.length in (0, len(m.turn1)), _what(v)
                again = tiers.take(m.turn2 + [5], session="s")
                assert again.length == len(m.turn1) and again.source == "disk", _what(v)
            else:
                assert first.length == len(m.turn2), _what(v)  # what is sound is untouched
            assert first.cache is None or holds(first.cache, first.length)
        if not v.target.session:
            got = _tiers(scratch, hit).take(hit.anon + [5])
            assert got.length == 0 and got.cache is None, _what(v)  # the anonymous state was the only candidate
        model_dir = scratch / v.target.model
        assert not os.path.lexists(scratch / v.target.rel), _what(v)
        assert _in_quarantine(model_dir, v.target.rel.relative_to(v.target.model)), _what(v)
    print(f"{sum(kinds.values())} variants in {time.perf_counter() - start:.1f} s: {dict(kinds)}")
    assert set(kinds) == set(KINDS) | set(SESSION_ONLY)


def _what(v: Variant) -> str:
    return f"{v.kind} on {v.target.rel}"


HEAVY = ["100 MiB manifest", "100,000-deep nesting", "token of 5,000 digits", "path 3000000", "path of 5,000 dots",
         "10,000 paths", "10,000 aliased arrays", "array past the end", "2,000 segments", "segment capacity 2**30",
         "manifest links to /dev/zero", "arrays link to /dev/urandom", "manifest is a FIFO", "token Infinity",
         "flip arrays", "truncate arrays", "shape transposed", "a layer more"]

_SCAN = """
import gc, json, resource, sys
from pathlib import Path
from statetrans.tiers import StateTiers
args = json.loads(sys.argv[1])
def scan(state):
    for m in args["models"]:
        StateTiers(state, m["identity"], m["layers"], 1 << 30, 1 << 40, vocab=m["vocab"])
    gc.collect()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
for _ in range(2):
    clean = scan(args["clean"])
damaged = max(scan(d) for d in args["damaged"])
print(json.dumps({"clean": clean, "damaged": damaged}))
"""


def test_scanning_damaged_files_takes_no_more_memory_than_a_clean_start(healthy, tmp_path):
    state, models = healthy
    dirs = []
    for i, kind in enumerate(HEAVY):
        for v in variants(state, tmp_path / "one", 8, seed=i, vocab=VOCAB, kinds=[kind] * 8):
            shutil.move(tmp_path / "one", tmp_path / f"d{len(dirs)}")
            dirs.append(str(tmp_path / f"d{len(dirs)}"))
            break
    shutil.copytree(state, tmp_path / "clean", symlinks=True)
    args = {"clean": str(tmp_path / "clean"), "damaged": dirs,
            "models": [{"identity": m.identity, "layers": m.layers, "vocab": VOCAB} for m in models.values()]}
    out = subprocess.run([sys.executable, "-c", _SCAN, json.dumps(args)], cwd=ROOT, check=True, text=True,
                         capture_output=True, timeout=120)
    rss = json.loads(out.stdout.splitlines()[-1])
    growth = rss["damaged"] - rss["clean"]
    print(f"peak RSS: clean start {rss['clean'] / 2**20:.1f} MiB, after {len(dirs)} damaged directories "
          f"{rss['damaged'] / 2**20:.1f} MiB (+{growth / 2**20:.2f} MiB)")
    assert growth <= 10 << 20
    # What a scan can tell (all but flipped bits past the arrays' header) it quarantined.
    assert sum(any((Path(d) / k / QUARANTINE).is_dir() for k in models) for d in dirs) >= len(dirs) - 1


def test_links_in_a_state_directory_are_never_followed(healthy, tmp_path):
    """anon/ or sessions/ replaced by links to another folder: what is there is neither
    read, swept nor moved; the links themselves are quarantined."""
    state, models = healthy
    scratch = tmp_path / "state"
    shutil.copytree(state, scratch, symlinks=True)
    outside = tmp_path / "outside"
    shutil.copytree(scratch, outside, symlinks=True)  # snapshots and all, as bait
    (outside / ".x.tmp-999999999-gone").mkdir()
    before = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    key, m = next(iter(models.items()))
    shutil.rmtree(scratch / key / "anon")
    (scratch / key / "anon").symlink_to(outside / key / "anon")
    shutil.rmtree(scratch / key / "sessions")
    (scratch / key / "sessions").symlink_to(outside / key / "sessions")
    tiers = _tiers(scratch, m)
    assert tiers.take(m.turn2 + [5], session="s").length == 0 and not tiers.entries
    for cmd in (["ls"], ["verify"], ["gc", "--keep", "0"]):
        assert _cli(scratch, *cmd).exception is None or cmd == ["verify"]
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == before
    assert {q.source for q in quarantined(scratch / key)} == {"anon", "sessions"}


# -- ownership on a shared volume ------------------------------------------------------
_OTHER = """
import json, sys, time
from pathlib import Path
from statetrans import disk
root = Path(sys.argv[1])
disk.claim(root)
print(json.dumps({"id": disk.me().id, "temp": disk.temp_name("g"), "tag": disk.owner_tag()}), flush=True)
sys.stdin.readline()
"""


def test_another_process_with_this_pid_is_not_taken_for_this_one(tmp_path):
    """Two containers on one volume may both run their server as PID 1: what the other
    wrote carries its own random id, and its lock file says whether it lives."""
    root = tmp_path / "state"
    (root / "model" / "anon").mkdir(parents=True)
    other = subprocess.Popen([sys.executable, "-c", _OTHER, str(root)], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        said = json.loads(other.stdout.readline())
        # As the other container would name them: our PID, its id (and its start time).
        twin = Owner(os.getpid(), temp_tag(said["temp"]).started, said["id"])
        temp = root / "model" / "anon" / f".g.tmp-{twin.pid}-{twin.started or 0}-{twin.id}-0badc0de"
        temp.mkdir()
        tag = {**said["tag"], "pid": os.getpid()}
        assert owner_live(twin, root / OWNERS) and owner_alive(tag, root / OWNERS) and not mine(tag)
        sweep_temporaries(root / "model")
        assert temp.exists()  # its in-flight write is not ours to sweep
        assert temp_tag(temp_name("g")).id != twin.id  # ours carry our own id
    finally:
        other.stdin.close()
        other.wait(timeout=30)
    assert not owner_live(twin, root / OWNERS) and not owner_alive(tag, root / OWNERS)  # its lock went with it
    sweep_temporaries(root / "model")
    assert not temp.exists()
    sweep_temporaries(root, depth=0)
    assert not (root / OWNERS / said["id"]).exists()  # the dead owner's lock file is reaped


def test_older_pid_only_temporaries_are_judged_by_pid_as_before(tmp_path):
    folder = tmp_path / "anon"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live, gone = folder / f".x.tmp-{os.getpid()}-live", folder / f".x.tmp-{dead.pid}-dead"
    live.mkdir()
    gone.mkdir()
    assert temp_tag(live.name) == Owner(os.getpid())
    sweep_temporaries(folder)
    assert live.exists() and not gone.exists()


# -- justfit state on odd names and a quarantine ------------------------------------------
def _cli(state: Path, *args: str):
    from click.testing import CliRunner

    from cli.main import main

    return CliRunner().invoke(main, ["state", *args, "--state-dir", str(state)])


@pytest.mark.parametrize("name", ["\ud800", "tab\there", "\x1b[31mred", '"quoted"', "plain name é"])
def test_state_ls_prints_and_rm_removes_any_stored_name(tiny_llama_dir, tmp_path, name):
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(kv=SMALL_PAGES, prefill_chunk=16,
                                                             state_dir=str(tmp_path)))
    run_tokens(engine, words(12, 4), GREEDY, session=name)
    engine.flush_sessions()
    out = _cli(tmp_path, "ls")
    assert out.exit_code == 0, out.output
    row = next(line for line in out.output.splitlines() if line.endswith(engine.name) or "llama" in line)
    printed = row.split("  ")[0].rstrip()
    assert "\x1b" not in out.output and "\t" not in row
    assert json.loads(_cli(tmp_path, "ls", "--json").output)[0]["session"] == name
    rm = _cli(tmp_path, "rm", printed)
    assert rm.exit_code == 0 and rm.output.startswith("removed session"), rm.output
    assert "nothing stored" in _cli(tmp_path, "ls").output


def test_state_rm_takes_the_raw_name_too(tiny_llama_dir, tmp_path):
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(kv=SMALL_PAGES, prefill_chunk=16,
                                                             state_dir=str(tmp_path)))
    run_tokens(engine, words(12, 5), GREEDY, session="tab\there")
    engine.flush_sessions()
    assert _cli(tmp_path, "rm", "tab\there").exit_code == 0
    assert _cli(tmp_path, "rm", "tab\there").exit_code != 0


def test_state_verify_quarantines_reports_and_removes(healthy, tmp_path):
    state, models = healthy
    scratch = tmp_path / "state"
    shutil.copytree(state, scratch, symlinks=True)
    rng = random.Random(0)
    todo = ["path 3000000", "100,000-deep nesting", "flip arrays", "snapshot folder is a link"]
    for target in snapshots(state):  # one damage on each snapshot
        kind = next(k for k in todo if applies(k, target))
        todo.remove(kind)
        damage(scratch, target, kind, rng, VOCAB)
    # Hostile extras the tools must survive: a stray file, a link out of the directory.
    key = next(iter(models))
    (scratch / key / "anon" / "notasnapshot").write_text("x")
    (scratch / key / "sessions" / "escape").symlink_to("/")
    for _ in range(2):
        for cmd in (["ls"], ["ls", "--json"], ["gc", "--keep", "1TiB"]):
            out = _cli(scratch, *cmd)
            assert out.exit_code == 0 and out.exception is None, (cmd, out.output)
    out = _cli(scratch, "verify")
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
    assert out.output.count("broken:") == 5 and out.output.count("quarantined as") == 5, out.output
    assert out.output.endswith("2 of 7 snapshots intact\n")  # each session's previous generation
    held = [q for d in scratch.iterdir() if d.is_dir() for q in quarantined(d)]
    assert len(held) == 5
    out = _cli(scratch, "verify")  # nothing new; the quarantine is still reported
    assert out.exit_code == 1 and out.output.count("quarantined:") == len(held), out.output
    assert "5 quarantined" in _cli(scratch, "ls").output
    out = _cli(scratch, "verify", "--remove")
    assert out.exit_code == 0 and out.output.count("(removed)") == len(held), out.output
    out = _cli(scratch, "verify")
    assert out.exit_code == 0 and "quarantined" not in out.output, out.output
    for m in models.values():  # every session opens at its previous generation
        assert _tiers(scratch, m).take(m.turn2 + [5], session="s").length == len(m.turn1)
