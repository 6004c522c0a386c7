"""The status page: its JSON document over a request's life, its auth, and the page
itself in headless Chromium against a live server (skipped, saying why, without it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from justfit.memory import rss_bytes
from tests.helpers.headless import Browser, chromium_path
from tests.server.test_server import LiveServer, request

LONG = {"prompt": "the " * 2500, "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
# The memory chart as the test reads it: uPlot's series (labels, dashes), the last value
# of the top band (MLX's total), of the RSS line and of the budget lines (MiB), the
# y scale's top, and the chart described in words.
CHART_JS = """(() => {
  const c = window.justfitChart, labels = c.series.map(s => s.label);
  const last = (i) => c.data[i][c.data[i].length - 1];
  const line = (start) => labels.findIndex(l => l && l.startsWith(start));
  const lines = {rss: line("process (RSS)"), budget: line("engine's share"), process_budget: line("whole-process")};
  return {labels, mlx: last(1), rss: last(lines.rss), budget: last(lines.budget),
          process_budget: last(lines.process_budget), ymax: c.scales.y.max,
          dash: Object.fromEntries(Object.entries(lines).map(([k, i]) => [k, !!c.series[i].dash])),
          described: document.getElementById('memdesc').textContent,
          aria: document.getElementById('memchart').getAttribute('aria-label')};
})()"""


@pytest.fixture(scope="module")
def tiny_engine(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir), budget="512MiB",
                  config=EngineConfig(prefill_chunk=64, context_limit=1 << 15))


def in_background(live, path, body, key="sekret") -> threading.Thread:
    t = threading.Thread(target=request, args=(live, "POST", path, body),
                         kwargs={"headers": {"Authorization": f"Bearer {key}"}}, daemon=True)
    t.start()
    return t


def wait_running(live, timeout=30.0) -> float:
    end = time.monotonic() + timeout
    while live.server.scheduler.running is None and time.monotonic() < end:
        time.sleep(0.002)
    assert live.server.scheduler.running is not None, "the request never started"
    return time.monotonic()


def test_live_document_follows_a_request(tiny_engine):
    live = LiveServer(tiny_engine, api_key="sekret")
    try:
        key = {"x-api-key": "sekret"}
        assert request(live, "GET", "/")[0] == 200  # the page itself holds nothing: no key
        assert request(live, "GET", "/static/vendor/uPlot.iife.min.js")[0] == 200
        for path in ("/static/../status_page.py", "/static/%2e%2e/status_page.py", "/static/..%2fstatus_page.py"):
            status, _, text = request(live, "GET", path)  # never a file outside the static folder
            assert status in (401, 403, 404) and "def add_routes" not in text, path
        assert request(live, "GET", "/v1/justfit/live")[0] == 401
        thread = in_background(live, "/v1/completions", {**LONG, "session": "s1"})
        wait_running(live)
        deadline = time.monotonic() + 30
        while True:  # until its first chunk is in (a loaded machine may take seconds)
            doc = json.loads(request(live, "GET", "/v1/justfit/live", headers=key)[2])
            running = doc["running"]
            if running and running["processed"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert running["prompt_tokens"] > 2000 and running["phase"] in ("prefill", "decode")
        assert running["route"] == "openai" and doc["queued"] == []
        assert sum(doc["now"]["kv"].values()) > 0  # the running request's pages are counted
        assert doc["now"]["weights_resident"] == doc["memory"]["weights"] > 0 and doc["budget"] == 512 * 2**20
        # The whole process beside MLX: its RSS holds MLX's memory and more; no whole-process budget here.
        mlx = sum(v for k, v in doc["now"].items() if k in ("weights_resident", "weights_materialized",
                                                            "transient", "states_memory", "mlx_cache"))
        assert doc["now"]["rss"] > mlx + sum(doc["now"]["kv"].values()) and doc["now"]["process_budget"] is None
        # Capacity: the format in use, then every page on each next step of its pressure ladder.
        assert [(c["format"], c["step"], c["in_use"]) for c in doc["capacity"]] == \
            [("q8c", 0, True), ("k8cv4", 1, False), ("q4c", 2, False), ("q3c", 3, False)]
        fmt = {c["format"]: c for c in doc["capacity"]}
        assert fmt["q3c"]["max_positions"] > fmt["q4c"]["max_positions"] > fmt["q8c"]["max_positions"] > 0
        assert fmt["q8c"]["left"] < fmt["q8c"]["max_positions"]
        assert all(c["past_context"] == (c["max_positions"] > doc["context_limit"]) for c in doc["capacity"])
        thread.join(60)
        live.idle()
        time.sleep(0.6)  # one more sample after the request
        since = doc["t"]
        after = json.loads(request(live, "GET", f"/v1/justfit/live?since={since}",
                                   headers={"Authorization": "Bearer sekret"})[2])
        assert after["running"] is None and after["history"] and all(s["t"] > since for s in after["history"])
        last = after["recent"][0]
        assert last["prompt_tokens"] == running["prompt_tokens"] and last["generated_tokens"] == 400
        assert last["prefill_s"] > 0 and last["decode_tps"] > 0
        (state,) = [s for s in after["states"] if s["name"] == "s1"]
        assert state["tokens"] >= running["prompt_tokens"] + 399 and state["where"] in ("memory", "disk")
        assert request(live, "GET", "/v1/justfit/live?since=x", headers=key)[0] == 400
    finally:
        live.close()


def test_memory_samples_put_the_process_beside_mlx(tiny_gemma3_dir):
    """Each sample holds the process's RSS and MLX's cache beside MLX's kinds, and under a
    whole-process budget both budgets: the engine's share (over MLX's memory) and the
    whole (over the RSS)."""
    from types import SimpleNamespace

    from justfit.server.status_live import LiveStatus

    # Over what this process already holds (in a whole-suite run, earlier tests' heap).
    budget = (rss_bytes() // 2**20 + 512) * 2**20
    engine = Engine(str(tiny_gemma3_dir), budget=budget, config=EngineConfig(budget_covers_process=True))
    now = LiveStatus(SimpleNamespace(engine=engine)).measure()
    mlx = now["weights_resident"] + now["weights_materialized"] + now["transient"] + now["states_memory"]
    assert now["process_budget"] == engine.budget.process == budget
    assert now["budget"] == engine.config.budget_bytes < budget  # less what the process holds besides MLX
    assert now["rss"] > mlx + now["mlx_cache"] + sum(now["kv"].values()) > 0


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (./dev installs Debian's "
                                                    "`chromium` where apt is available): browser test skipped")
def test_page_in_headless_chromium(smollm2_gguf, tmp_path):
    """The page during a request: charts drawn, the running request shown within 1 s
    of starting, its numbers those of the status endpoints; the memory chart's bands
    (MLX's kinds) and lines (the process's RSS, the budgets) on one scale, and the
    capacity table for the format in use with the trained context marked; a screenshot."""
    # A whole-process budget over what this process already holds (in a whole-suite run,
    # earlier tests' heap), so the engine's share is the same whatever ran before.
    budget_mib = rss_bytes() // 2**20 + 620
    # Its own state folder: earlier tests' sessions (other keys') are not this server's to count.
    engine = Engine(str(smollm2_gguf), budget=f"{budget_mib}MiB",
                    config=EngineConfig(budget_covers_process=True, state_dir=str(tmp_path / "state")))
    live = LiveServer(engine, api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    body = {"messages": [{"role": "user", "content": "Tell me about lighthouses. " * 120}], "max_tokens": 8,
            "temperature": 0, "stream": True}

    async def check() -> dict:
        async with Browser(height=1500) as b:
            await b.goto(live.url + "/")
            # No key yet: the page asks for it, then keeps it in the tab's session storage.
            assert await b.wait_for("!document.getElementById('keyform').hidden")
            await b.js("document.getElementById('key').value = 'sekret';"
                       "document.getElementById('keyform').requestSubmit(); true")
            assert await b.wait_for("document.querySelectorAll('#memchart canvas').length > 0")
            assert await b.js("sessionStorage.getItem('justfit-api-key')") == "sekret"
            short = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "session": "demo"}
            await asyncio.to_thread(request, live, "POST", "/v1/chat/completions", short, None, key)
            assert await b.wait_for("document.querySelectorAll('#recent tr').length === 1")
            in_background(live, "/v1/chat/completions", body)  # cancelled when the server closes
            started = await asyncio.to_thread(wait_running, live)
            shown = await b.wait_for("document.querySelector('[data-field=running]').dataset.value === 'prefill'"
                                     " || document.querySelector('[data-field=running]').dataset.value === 'decode'")
            seen_after = time.monotonic() - started
            # The table shows each poll's `now`; the chart draws the sampled history, which
            # holds the running request's KV from the first sample after it began.
            await b.wait_for("document.querySelector('[data-field=\"mem:kv:full\"]') !== null && "
                             "window.justfitChart.series.some(s => s.label === 'KV full')", timeout=5)
            page = await b.js("({fields: Object.fromEntries([...document.querySelectorAll('[data-field]')]"
                              ".map(e => [e.dataset.field, e.dataset.value])), last: window.justfitLast,"
                              " canvases: document.querySelectorAll('.uplot canvas').length, chart: " + CHART_JS +
                              ", capacity: [...document.querySelectorAll('#capacity tr')].map(r => r.innerText)})")
            status = json.loads((await asyncio.to_thread(request, live, "GET", "/v1/justfit/status", None, None,
                                                         key))[2])
            await b.screenshot(tmp_path / "status-page.png")
            return {"shown": shown, "seen_after": seen_after, "page": page, "status": status}

    try:
        r = asyncio.run(check())
    finally:
        live.close()
    page, fields, last, status = r["page"], r["page"]["fields"], r["page"]["last"], r["status"]
    assert r["shown"] and r["seen_after"] < 1.0, f"the page showed the request {r['seen_after']:.2f} s after it began"
    assert page["canvases"] >= 1
    # What the page shows is what the endpoints said.
    assert fields["model"] == status["model"] == last["model"] and fields["policy"] == status["policy"]
    assert fields["kv_format"] == status["kv_format"] and int(fields["context_limit"]) == status["context_limit"]
    assert int(fields["budget"]) == status["memory"]["budget"] == last["budget"] < budget_mib * 2**20  # the engine's share
    assert last["process_budget"] == budget_mib * 2**20
    assert int(fields["mem:weights_resident"]) == status["memory"]["weights"] == last["now"]["weights_resident"]
    assert int(fields["mem:kv:full"]) == last["now"]["kv"]["full"] > 0  # the running request's KV
    assert int(fields["prompt_tokens"]) == last["running"]["prompt_tokens"] > 500
    # Capacity: the format in use first, then the ladder's steps; the trained context a row of
    # its own, before the first count past it; counts past it flagged as needing extrapolation.
    in_use, *steps = last["capacity"]
    assert in_use["in_use"] and in_use["format"] == status["kv_format"] and len(steps) >= 1
    assert int(fields["capacity:" + in_use["format"]]) == in_use["max_positions"]
    assert int(fields["capacity:trained"]) == last["context_limit"] == 8192
    for c in last["capacity"]:
        assert fields["past:" + c["format"]] == ("true" if c["max_positions"] > 8192 else "false")
    rows = r["page"]["capacity"]
    trained = next(i for i, row in enumerate(rows) if row.startswith("trained context"))
    past = [i for i, row in enumerate(rows) if "needs a model that extrapolates" in row]
    assert past and all(i > trained for i in past) and len(rows) == len(last["capacity"]) + 1
    # The memory chart: MLX's kinds stacked, the process's RSS and both budgets as lines, one MiB scale.
    chart, mib = page["chart"], 2**20
    for label in ("weights resident", "KV full", "MLX cache (freed, kept)", "process (RSS)",
                  "engine's share of the budget (MLX's memory)", "whole-process budget (RSS)"):
        assert label in chart["labels"], (label, chart["labels"])
    assert chart["process_budget"] == budget_mib and last["now"]["process_budget"] == budget_mib * mib
    assert chart["budget"] == pytest.approx(last["now"]["budget"] / mib, rel=0.2)  # the engine's share
    assert chart["budget"] < budget_mib
    assert 0 < chart["mlx"] < chart["rss"] < budget_mib <= chart["ymax"], (chart, last["now"])  # bands under the RSS, under the budget line
    assert chart["rss"] == pytest.approx(last["now"]["rss"] / mib, rel=0.3)
    assert chart["dash"]["budget"] and chart["dash"]["process_budget"] and not chart["dash"]["rss"]
    assert int(fields["mem:rss"]) == last["now"]["rss"] and int(fields["mem:process_budget"]) == budget_mib * mib
    assert int(fields["mem:outside"]) == last["now"]["rss"] - int(fields["mem:mlx_total"]) > 0
    shown = f"{budget_mib / 1024:.1f} GiB" if budget_mib >= 1024 else f"{budget_mib:.1f} MiB"  # as the page writes it
    for words in ("MLX holds", "(RSS, the solid line)", "outside MLX", f"whole-process budget {shown}"):
        assert words in chart["described"] and words in chart["aria"], (words, chart["described"])
    # the running request may end, storing its state, between the page's last poll and the status read
    assert int(fields["states"]) == len(last["states"]) and status["states"]["stored"] - len(last["states"]) in (0, 1)
    assert "demo" in status["sessions"]["own"] and any(s["name"] == "demo" for s in last["states"])
    shot = tmp_path / "status-page.png"
    assert shot.stat().st_size > 20_000
    if os.environ.get("JUSTFIT_SCREENSHOT"):  # the closing note's copy, e.g. bench/results/status-page-DATE.png
        shutil.copy(shot, Path(os.environ["JUSTFIT_SCREENSHOT"]))
