"""StateTrans: snapshots round-trip byte-exactly, continue token-identically, and
refuse what is damaged or foreign without touching the current state."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from kvexec import KVConfig
from statetrans import SnapshotError, capture, load_snapshot

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = "the state of things " * 6


def _tokens(engine, prompt, sp) -> list[int]:
    return [c.token for c in engine.generate(prompt, sp) if c.token is not None]


KV = {"paged q8c": KVConfig(format="q8c", page_size=32, hot_window=32, block_tokens=64),
      "paged fp16": KVConfig(format="fp16", page_size=16, hot_window=16, block_tokens=64),
      "mlx-lm": None}


# (tiny llama's head_dim 16 is too small for q8c's groups; gemma3's 32 is not)
@pytest.mark.parametrize("arch,kv", [("llama", "paged fp16"), ("llama", "mlx-lm"), ("gemma3", "paged q8c"),
                                     ("gemma3", "paged fp16"), ("gemma3", "mlx-lm")])
def test_restore_is_byte_exact_and_continues_token_identically(arch, kv, tiny_llama_dir, tiny_gemma3_dir, tmp_path):
    path = tiny_llama_dir if arch == "llama" else tiny_gemma3_dir
    cfg = lambda: EngineConfig(kv=KV[kv], prefill_chunk=16)  # noqa: E731
    whole = _tokens(Engine(str(path), config=cfg()), PROMPT, GREEDY)

    first = Engine(str(path), config=cfg())
    head = _tokens(first, PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    info = first.save_state(str(tmp_path / "snap"))
    assert info.tokens == len(first.cached_tokens) and info.file_bytes >= info.state_bytes

    second = Engine(str(path), config=cfg())
    second.load_state(str(tmp_path / "snap"))
    assert second.cached_tokens == first.cached_tokens
    a, _ = capture(first.states.last.cache)
    b, _ = capture(second.states.last.cache)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)

    prompt = second.encode(PROMPT) + head  # the conversation so far: only the last token is new
    reply = second.reply(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    rest = reply.tokens
    assert reply.stats.cached_tokens == len(prompt) - 1
    assert head + rest == whole


@pytest.fixture
def saved(tiny_llama_dir, tmp_path):
    engine = Engine(str(tiny_llama_dir))
    _tokens(engine, PROMPT, GREEDY)
    engine.save_state(str(tmp_path / "snap"))
    return engine, tmp_path / "snap"


def _fresh_with_state(tiny_llama_dir):
    engine = Engine(str(tiny_llama_dir))
    _tokens(engine, "other words", GREEDY)
    return engine, engine.cached_tokens


def test_corrupted_and_truncated_snapshots_are_refused(saved, tiny_llama_dir):
    _, snap = saved
    engine, before = _fresh_with_state(tiny_llama_dir)
    arrays = snap / "arrays.safetensors"
    data = bytearray(arrays.read_bytes())
    data[len(data) // 2] ^= 0xFF
    arrays.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match="corrupted"):
        engine.load_state(str(snap))
    arrays.write_bytes(bytes(data[: len(data) // 3]))
    with pytest.raises(SnapshotError, match="truncated"):
        engine.load_state(str(snap))
    (snap / "manifest.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="damaged manifest"):
        engine.load_state(str(snap))
    with pytest.raises(SnapshotError, match="no snapshot"):
        engine.load_state(str(snap.parent / "nothing-here"))
    assert engine.cached_tokens == before  # nothing loaded, nothing lost


def test_foreign_snapshots_are_refused_with_the_reason(saved, tiny_llama_dir, tiny_gemma3_dir):
    _, snap = saved
    other_model = Engine(str(tiny_gemma3_dir))
    with pytest.raises(SnapshotError, match="saved with model"):
        other_model.load_state(str(snap))
    other_kv = Engine(str(tiny_llama_dir), config=EngineConfig(kv=None))
    with pytest.raises(SnapshotError, match="KV format"):
        other_kv.load_state(str(snap))
    manifest = json.loads((snap / "manifest.json").read_text())
    tampered = dict(manifest, tokens=[t ^ 1 for t in manifest["tokens"]])  # same length, other tokens
    (snap / "manifest.json").write_text(json.dumps(tampered))
    with pytest.raises(SnapshotError, match="does not match its arrays"):
        Engine(str(tiny_llama_dir)).load_state(str(snap))
    manifest["version"] = 99
    (snap / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match="version 99"):
        Engine(str(tiny_llama_dir)).load_state(str(snap))


def test_failed_save_leaves_the_previous_snapshot_intact(saved, monkeypatch):
    import statetrans.snapshot as snapshot_mod

    engine, snap = saved
    before = load_snapshot(snap)[1]
    _tokens(engine, PROMPT + "and more", GREEDY)

    def disk_full(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_mod.mx, "save_safetensors", disk_full)
    with pytest.raises(OSError, match="No space"):
        engine.save_state(str(snap))
    assert load_snapshot(snap)[1]["tokens"] == before["tokens"]
    assert sorted(p.name for p in snap.parent.iterdir()) == ["snap"]  # no temporary left


def test_nothing_to_save_is_a_clear_error(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="nothing to save"):
        Engine(str(tiny_llama_dir)).save_state(str(tmp_path / "s"))


def test_smollm2_snapshot_resumes_token_identically(smollm2_gguf, tmp_path):
    msgs = [{"role": "user", "content": "List three fruits."}]
    whole = _tokens(Engine(str(smollm2_gguf)), msgs, GREEDY)
    first = Engine(str(smollm2_gguf))
    head = _tokens(first, msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    info = first.save_state(str(tmp_path / "smol"))
    arrays, _ = capture(first.states.last.cache)
    assert info.file_bytes <= 1.05 * sum(a.nbytes for a in arrays.values()) + 65536  # manifest + header
    second = Engine(str(smollm2_gguf))
    second.load_state(str(tmp_path / "smol"))
    rest = _tokens(second, second.encode(msgs) + head, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert head + rest == whole


def test_finished_and_cancelled_requests_leak_no_memory(tiny_gemma3_dir):
    import gc

    def settled() -> int:
        gc.collect()
        mx.clear_cache()
        return mx.get_active_memory()

    engine = Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16))
    _tokens(engine, PROMPT, GREEDY)  # warm: lazy constants (RoPE tables, masks) exist now
    engine.reset()
    base = settled()
    for _ in range(2):
        _tokens(engine, PROMPT * 2, GREEDY)
        assert engine.cached_tokens and settled() > base  # the kept state holds memory
        engine.reset()
        assert settled() == base
    gen = engine.generate(PROMPT * 2, GREEDY)
    next(gen), next(gen)
    gen.close()  # a dropped client
    assert len(engine.cached_tokens) == len(engine.encode(PROMPT * 2)) + 1
    engine.reset()
    assert settled() == base


def test_state_command_lists_verifies_removes_and_collects(tiny_llama_dir, tmp_path):
    from click.testing import CliRunner

    from cli.main import main

    kv = KVConfig(format="fp16", page_size=16, hot_window=16, block_tokens=64)
    engine = Engine(str(tiny_llama_dir), config=EngineConfig(kv=kv, prefill_chunk=16, state_dir=str(tmp_path),
                                                             state_memory=0))
    _tokens(engine, PROMPT, GREEDY)  # anonymous, spilled
    _tokens(engine, "a named one " * 3, GREEDY)
    list(engine.generate("mine " * 5, GREEDY, session="mine"))
    list(engine.generate("theirs " * 5, GREEDY, session="theirs"))
    engine.flush_sessions()
    run = lambda *a: CliRunner().invoke(main, ["state", *a, "--state-dir", str(tmp_path)])  # noqa: E731

    out = run("ls")
    assert out.exit_code == 0 and "mine" in out.output and "theirs" in out.output
    assert out.output.count("(anonymous)") == 2 and "fp16" in out.output
    rows = json.loads(run("ls", "--json").output)
    assert {r["session"] for r in rows} == {None, "mine", "theirs"}

    assert run("verify").output.endswith("4 of 4 snapshots intact\n")
    anon = next(r["path"] for r in rows if r["session"] is None)
    (Path(anon) / "arrays.safetensors").write_bytes(b"damaged")
    out = run("verify")
    assert out.exit_code == 1 and "broken:" in out.output and "3 of 4" in out.output
    assert "(removed)" in run("verify", "--remove").output
    assert run("verify").exit_code == 0

    assert run("rm", "theirs").output == "removed session 'theirs'\n"
    assert "no session 'theirs'" in run("rm", "theirs").output
    mine = next(Path(r["path"]) for r in rows if r["session"] == "mine")
    shutil.copytree(mine, mine.with_name("g000000000002"))  # a newer one, as if cleanup had not run yet
    assert "mine (superseded)" in run("ls").output
    # The superseded generation goes; the anonymous state stays: its writer (this process) lives.
    assert "removed 1 snapshots" in run("gc", "--keep", "0").output
    assert "superseded" not in run("ls").output and "(anonymous)" in run("ls").output
    # A state written by a process that has ended is garbage once past --keep; sessions never are.
    script = (f"import justfit; from justfit import Engine, SamplingParams; from justfit.config import EngineConfig; "
              f"from kvexec import KVConfig; e = Engine({str(tiny_llama_dir)!r}, config=EngineConfig(kv=KVConfig("
              f"format='fp16', page_size=16, hot_window=16, block_tokens=64), state_dir={str(tmp_path)!r}, "
              f"state_memory=0)); list(e.generate('gone ' * 9, SamplingParams(max_tokens=2)))")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2])
    assert len(json.loads(run("ls", "--json").output)) == 3
    assert "removed 1 snapshots" in run("gc", "--keep", "0").output
    rows = json.loads(run("ls", "--json").output)
    assert [r["session"] for r in rows] == [None, "mine"] or [r["session"] for r in rows] == ["mine", None]
    assert Engine(str(tiny_llama_dir), config=EngineConfig(kv=kv, state_dir=str(tmp_path))).sessions() == {
        "mine": next(r["tokens"] for r in rows if r["session"] == "mine")}
