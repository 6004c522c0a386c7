"""StateTrans's policies decide and return, without touching a disk: the sessions'
quota says which folders to evict from a snapshot of their usage (the ledger applies
it, against a store that stands in for the disk here), the disk shares are arithmetic
on the limits, and parking says what a parked state is and checks what is read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from statetrans.parking import Parked, check_unparked, parked_as, parked_entry, to_park
from statetrans.quota import (DiskShares, SessionQuota, Trim, anonymous_room, anonymous_shares, disk_shares,
                              unshared_limit)
from statetrans.session_ledger import SessionLedger
from statetrans.sessions import Usage
from statetrans.snapshot import SnapshotError

A, B = "key-a", "key-b"


def test_an_unbounded_quota_evicts_nothing():
    assert SessionQuota(None).decide({"f": Usage(10, 1.0)}, {}, "g") == ()


def test_without_scopes_one_trim_over_every_folder_oldest_first_never_the_one_written():
    usage = {"new": Usage(10, 9.0), "old": Usage(10, 1.0), "mid": Usage(10, 5.0), "tie": Usage(10, 5.0)}
    got = SessionQuota(25).decide(usage, {}, spare="new")
    assert got == (Trim(frozenset(usage), ("old", "mid", "tie"), 25, frozenset()),)


def test_with_scopes_the_writers_share_first_then_what_the_shares_leave():
    usage = {"a1": Usage(10, 1.0), "a2": Usage(10, 2.0), "b1": Usage(10, 0.5), "x1": Usage(10, 0.1),
             "u1": Usage(10, 0.2)}
    scope_of = {"a1": A, "a2": A, "b1": B, "x1": "", "u1": None}  # "" has no share; u1's scope is unknown
    own, rest = SessionQuota(100, scopes=frozenset({A, B})).decide(usage, scope_of, spare="a2", scope=A)
    assert own == Trim(frozenset({"a1", "a2"}), ("a1",), 50)
    assert rest == Trim(frozenset({"x1", "u1"}), ("x1", "u1"), 100, frozenset({"a1", "a2", "b1"}))


def test_a_scope_without_a_share_trims_only_what_the_shares_leave():
    usage = {"a1": Usage(10, 1.0), "x1": Usage(10, 2.0)}
    (rest,) = SessionQuota(100, scopes=frozenset({A})).decide(usage, {"a1": A, "x1": ""}, spare="x1", scope="")
    assert rest == Trim(frozenset({"x1"}), (), 100, frozenset({"a1"}))


def test_the_quota_is_built_once():
    quota = SessionQuota(100, keep_s=60.0)
    shared = quota.shared_among([A, B])
    assert shared.scopes == {A, B} and quota.scopes == frozenset() and shared.limit == 100
    with pytest.raises(AttributeError):
        quota.limit = 5  # type: ignore[misc]
    assert quota.recent(100.0, 159.0) and not quota.recent(100.0, 160.0)


def test_disk_shares():
    assert disk_shares(None, 100, A, frozenset({A, B})) == DiskShares(None, 50)
    assert disk_shares(90, 100, A, frozenset({A, B, "c"})) == DiskShares(30, 33)
    assert disk_shares(90, 100, "", frozenset({A})).as_dict() == {"sessions": None, "anonymous": None}
    assert disk_shares(90, -5, A, frozenset({A})) == DiskShares(90, 0)  # the quarantine over the anonymous part
    assert anonymous_room(100, 30) == 70 and anonymous_room(10, 30) == -20
    assert anonymous_shares(70, frozenset({A, B})) == {A: 35, B: 35}
    assert anonymous_shares(-20, frozenset({A})) == {A: 0} and anonymous_shares(70, frozenset()) == {}
    assert unshared_limit(100, 70) == 30


class _Store:
    """A session store's folders in memory: usage, which are busy (a live writer's), scopes."""

    def __init__(self, usage: dict[str, Usage], busy=(), scopes=None):
        self.disk, self.busy, self.scopes = dict(usage), set(busy), dict(scopes or {})
        self.dropped: list[str] = []

    def usage(self) -> dict[str, Usage]:
        return dict(self.disk)

    def folder_usage(self, folder: str) -> Usage | None:
        return self.disk.get(folder)

    def folder_scope(self, folder: str) -> str | None:
        return self.scopes.get(folder)

    def drop_folder(self, folder: str) -> bool:
        if folder in self.busy or folder not in self.disk:
            return False
        del self.disk[folder]
        self.dropped.append(folder)
        return True


def test_the_ledger_evicts_in_order_skips_busy_folders_and_counts():
    store = _Store({f"f{i}": Usage(10, float(i)) for i in range(6)}, busy={"f1"})
    ledger = SessionLedger(SessionQuota(30, keep_s=0))
    got = ledger.enforce(store, spare="f5")
    assert store.dropped == ["f0", "f2", "f3"]  # f1's live writer spares it
    assert got == [("f0", False), ("f2", False), ("f3", False)]
    assert ledger.evicted == 3 and ledger.evicted_recent == 0 and ledger.total == 30


def test_the_ledger_puts_a_folder_used_since_back_in_the_order():
    store = _Store({"f0": Usage(10, 0.0), "f1": Usage(10, 1.0), "f2": Usage(10, 2.0)})
    ledger = SessionLedger(SessionQuota(30, keep_s=0))
    assert ledger.enforce(store, spare="f2") == []  # reads the snapshot: within the limit yet
    ledger.noted("f3", Usage(10, 3.0))
    store.disk["f3"] = Usage(10, 3.0)
    store.disk["f0"] = Usage(10, 4.0)  # another process resumed f0 since: the snapshot does not know
    assert ledger.enforce(store, spare="f3") == [("f1", False)] and store.dropped == ["f1"]


def test_the_ledger_keeps_each_scope_within_its_share():
    usage = {"a0": Usage(10, 0.0), "a1": Usage(10, 1.0), "b0": Usage(10, -1.0), "x0": Usage(10, -2.0)}
    store = _Store(usage, scopes={"a0": A, "a1": A, "b0": B, "x0": ""})
    ledger = SessionLedger(SessionQuota(20, keep_s=1e12, scopes=frozenset({A, B})))
    assert ledger.enforce(store, spare="a1", scope=A) == [("a0", True), ("x0", True)]  # never B's
    assert ledger.evicted_recent == 2 and ledger.scope_bytes(store, B) == 10


def test_parking_decides_the_record_and_checks_what_comes_back():
    e = to_park([1, 2, 3], {"temperature": 0.0}, A)
    assert e.session is None and e.path is None and e.scope == A
    parked = parked_as(e, Path("/nowhere") / e.key, 123, {"pid": 1}, [{"class": "KVCache"}], 0.5)
    assert isinstance(parked, Parked) and parked.tokens == [1, 2, 3] and parked.scope == A and parked.trimmable
    check_unparked(parked, {"tokens": [1, 2, 3]})
    with pytest.raises(SnapshotError):
        check_unparked(parked, {"tokens": [1, 2]})
    back = parked_entry(parked)
    assert back.path == parked.path and back.disk_bytes == 123 and back.scope == A and back.tokens == [1, 2, 3]
