"""The pressure ladder's fidelity floor: pages step down only to formats whose
measured top-1 for the model holds the floor; past it, refusal (the limit is not met
by lossy steps) or retention (least attended pages dropped), as configured."""

import mlx.core as mx
import numpy as np
import pytest

from kvexec import KVConfig, PageStore, ladder

SMALL = dict(page_size=32, hot_window=16, sink_tokens=2, block_tokens=64)
# SmolLM2's measured top-1 per format, every page in it (docs/BENCHMARKS.md, KVExec fidelity).
MEASURED = {"k8cv4": 0.9902, "q4c": 0.9790, "q3c": 0.9363}


def _names(config: KVConfig) -> list[str]:
    return [f.name for f in ladder(config, 64)]


def test_ladder_stops_at_the_last_rung_that_holds_the_floor():
    assert _names(KVConfig(fidelity_floor=0.99, measured_top1=MEASURED)) == ["q8c", "k8cv4"]
    assert _names(KVConfig(fidelity_floor=0.97, measured_top1=MEASURED)) == ["q8c", "k8cv4", "q4c"]
    assert _names(KVConfig(fidelity_floor=0.995, measured_top1=MEASURED)) == ["q8c"]
    # an unmeasured rung ends the ladder: nothing below it is assumed to hold the floor
    assert _names(KVConfig(fidelity_floor=0.99, measured_top1={"q4c": 0.999, "q3c": 0.999})) == ["q8c"]
    assert _names(KVConfig(measured_top1=MEASURED)) == ["q8c", "k8cv4", "q4c", "q3c"]  # no floor: every rung
    # JSON round trips give lists back
    assert KVConfig(measured_top1=[["q4c", 0.991]]).measured_top1 == (("q4c", 0.991),)
    with pytest.raises(ValueError, match="past_floor"):
        KVConfig(past_floor="drop")
    with pytest.raises(ValueError, match="fidelity_floor"):
        KVConfig(fidelity_floor=1.5)


def _fed(config: KVConfig, share: float) -> PageStore:
    """1,024 tokens into a store whose page limit is `share` of what q8c pages take."""
    rng = np.random.default_rng(0)
    kv = [mx.array(rng.normal(size=(1, 3, 64, 64)).astype(np.float32)) for _ in range(32)]
    full = PageStore(KVConfig(**SMALL))
    for i in range(0, 32, 2):
        full.append(kv[i], kv[i + 1])
    store = PageStore(config)
    store.page_limit = int(share * full.page_bytes())
    for i in range(0, 32, 2):
        store.append(kv[i], kv[i + 1])
    return store


def test_past_the_floor_pages_never_go_lossier_and_retention_drops_pages_instead():
    floor = dict(SMALL, fidelity_floor=0.97, measured_top1=MEASURED)
    # 35% of q8c's bytes: only q3c (under the floor) could reach it
    refused = _fed(KVConfig(**floor), 0.35)
    assert set(refused.formats()) <= {"q8c", "k8cv4", "q4c"} and "q4c" in refused.formats()
    assert refused.page_bytes() > refused.page_limit and refused.evicted == 0  # the planner refuses this size
    retained = _fed(KVConfig(**floor, past_floor="retain"), 0.35)
    assert set(retained.formats()) <= {"q8c", "k8cv4", "q4c"}
    assert retained.page_bytes() <= retained.page_limit and retained.evicted > 0
    assert retained.retained() + retained.evicted == 1024
    unfloored = _fed(KVConfig(**SMALL), 0.35)
    assert "q3c" in unfloored.formats()  # without the floor the same limit ends in q3c
