"""The quarantine is bounded and counted: past its limit the oldest quarantined items
are deleted first (one larger than the limit goes too), its bytes come out of the
anonymous states' disk limit, and `justfit state verify` shows it (count, bytes,
limit) and keeps it within the limit `--state-disk` gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from statetrans.disk_tier import ANON
from statetrans.quarantine import NOTE, QUARANTINE, quarantine, quarantine_bytes, quarantined, tree_bytes
from statetrans.quota import quarantine_limit, split_state_disk
from statetrans.snapshot import SnapshotError
from tests.helpers.state_engines import paged_engine, prefilled, tiers_like, words

ITEM = 4096  # bytes of each forged snapshot's one file


def _forged(model: Path, name: str, size: int = ITEM) -> Path:
    """A snapshot folder under `model`'s anon/ holding one file of `size` bytes."""
    path = model / ANON / name
    path.mkdir(parents=True)
    (path / "arrays.safetensors").write_bytes(b"\0" * size)
    return path


def test_quarantine_past_its_limit_deletes_the_oldest_first(tmp_path):
    model = tmp_path / "model"
    limit = 3 * ITEM + ITEM // 2  # three items and their notes fit, four do not
    moved = [quarantine(model, _forged(model, f"s{i}"), SnapshotError(f"forged {i}"), limit) for i in range(6)]
    assert all(m is not None for m in moved)
    held = quarantined(model)
    assert [q.source for q in held] == [f"anon/s{i}" for i in (3, 4, 5)]  # the newest three, oldest first
    assert [q.reason for q in held] == [f"forged {i}" for i in (3, 4, 5)]
    assert all(not m.exists() and not m.with_name(m.name + NOTE).exists() for m in moved[:3])
    assert all(q.bytes == tree_bytes(q.path) + tree_bytes(q.path.with_name(q.path.name + NOTE)) > ITEM for q in held)
    assert quarantine_bytes(model) == sum(q.bytes for q in held) <= limit
    # An item larger than the whole limit leaves nothing behind, itself included.
    big = quarantine(model, _forged(model, "big", 2 * limit), SnapshotError("huge"), limit)
    assert big is not None and not big.exists()
    assert quarantined(model) == [] and quarantine_bytes(model) == 0
    # Without a limit (a library's own tiers): nothing is deleted.
    for i in range(5):
        quarantine(model, _forged(model, f"t{i}"), SnapshotError("forged"))
    assert len(quarantined(model)) == 5


def test_quarantine_limit_defaults():
    total = 20 * 2**30
    assert quarantine_limit(total, split_state_disk(total)[1]) == 2**30  # 1/20 of the total
    assert quarantine_limit(total, 2**20) == 2**20  # never more than the anonymous states' part
    assert quarantine_limit(total, 0) == 0


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory):
    return paged_engine(tiny_llama_dir, tmp_path_factory.mktemp("quarantine-engine"))


def test_the_quarantine_counts_against_the_anonymous_limit(engine, tmp_path):
    probe = tiers_like(engine, tmp_path / "probe", memory=0)
    probe.put(words(12, 0), prefilled(engine, words(12, 0)))
    probe.fit()
    size = probe.index.anonymous_disk_bytes  # one state's (its manifest's digits make others differ a little)
    limit = 10 * size + size // 2
    tiers = tiers_like(engine, tmp_path / "state", memory=0)
    tiers.disk_limit = limit
    prompts = [words(12, 100 + i) for i in range(10)]
    for tokens in prompts:
        tiers.put(tokens, prefilled(engine, tokens))
        tiers.fit()
    assert len(tiers.index.anonymous_on_disk()) == 10  # all ten fit while the quarantine is empty
    # Another process quarantines four states' worth of forged files.
    for i in range(4):
        quarantine(tiers.dir, _forged(tiers.dir, f"forged-{i}", size - 200), SnapshotError("forged"))
    held = quarantine_bytes(tiers.dir)
    assert 3 * size < held <= 4 * size
    again = tiers_like(engine, tmp_path / "state", memory=0)  # a restart reads the quarantine
    again.disk_limit = limit
    again.fit()
    assert again.index.anonymous_disk_bytes + held <= limit
    assert tree_bytes(again.dir / ANON) == again.index.anonymous_disk_bytes  # the files went, not only the index
    kept = [t for t in prompts if again.take(t + [5]).length == len(t)]
    assert kept == prompts[4:]  # the four least recently used went, no more


def _cli(state: Path, *args: str):
    from click.testing import CliRunner

    from cli.main import main

    return CliRunner().invoke(main, ["state", *args, "--state-dir", str(state)])


def test_state_verify_shows_the_quarantine_within_its_limit(tmp_path):
    model = tmp_path / "state" / "model"
    for i in range(4):
        quarantine(model, _forged(model, f"s{i}", 2000), SnapshotError(f"forged {i}"))
    # --state-disk 100KiB: the quarantine keeps 5 KiB, two of the four items.
    out = _cli(tmp_path / "state", "verify", "--state-disk", "100KiB")
    assert out.exit_code == 1, out.output  # something is quarantined: not all clear
    held = quarantined(model)
    assert [q.source for q in held] == ["anon/s2", "anon/s3"]
    size = sum(q.bytes for q in held)
    assert size <= 5 * 1024
    assert f"quarantine: 2 items, {size / 1024:.1f} KiB (limit 5.0 KiB per model)" in out.output, out.output
    assert out.output.count("quarantined:") == 2 and "forged 3" in out.output and "forged 0" not in out.output
    out = _cli(tmp_path / "state", "verify", "--state-disk", "100KiB", "--remove")
    assert out.exit_code == 0 and "quarantine: 0 items, 0.0 KiB (limit 5.0 KiB per model)" in out.output, out.output
    assert quarantined(model) == []
    assert _cli(tmp_path / "state", "verify", "--state-disk", "lots").exit_code == 2  # a bad size: a usage error
