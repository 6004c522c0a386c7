"""/v1/justfit/status's figures for KV pages on disk: what a context will cost before it is filled."""

from __future__ import annotations

import json

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from tests.helpers.server_harness import CHAT, LiveServer, request


@pytest.fixture(scope="module")
def live(tiny_gemma3_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-pages")
    engine = Engine(str(tiny_gemma3_dir), budget=64 << 20,
                    config=EngineConfig(prefill_chunk=16, kv_disk=str(folder), kv_disk_layers=1))
    s = LiveServer(engine, max_queue=4)
    yield s
    s.close()


def test_status_says_what_pages_on_disk_cost(live):
    request(live, "POST", "/v1/chat/completions", CHAT)
    disk = json.loads(request(live, "GET", "/v1/justfit/status")[2])["kv_disk"]
    assert disk["folder"] and disk["bytes_per_position"] > 0
    most = disk["at_max"]  # the most the budget holds with every growing layer's pages on disk
    assert most["read_per_token"] == most["bytes_on_disk"] > 0 and most["resident_total"] <= 64 << 20
    assert disk["at_context_limit"]["positions"] > 0 and disk["positions_on_disk_last"] >= 0
    assert live.server.kv_disk.bandwidth.wait(30) is not None  # measured in its own thread, not the loop's
    disk = json.loads(request(live, "GET", "/v1/justfit/status")[2])["kv_disk"]
    bw = disk["bandwidth"]["bytes_per_s"]
    assert disk["bandwidth"]["method"] and bw > 0
    most = disk["at_max"]
    assert most["predicted_tok_s"] == pytest.approx(bw / most["read_per_token"], rel=1e-3)


def test_costs_at_no_positions_on_disk(live):
    """A budget that holds no position with every growing layer's pages on disk: the status's
    figures at 0 positions are figures, not a server error."""
    planner = live.server.engine.planner
    probe = planner.edge_footprint(disk_layers=planner.edge_footprint().shape.full_layers)
    zero = probe.at(0)
    assert zero.positions == 0 and zero.total > 0
