"""Speed comparisons of the same work: alternating rounds, ratios as the median and range
of each round's pair, JustFit with drafts off beside llama-bench, a prompt after a depth
(one llama-bench fill for both of its tests); llama-bench is a stand-in script here."""

import json
import stat
import sys

import pytest

# A stand-in llama-bench: logs its arguments, prints one JSON test per -p/-n given (rates
# from the arguments, so each test's figure is known).
FAKE_BENCH = """import json, sys
a = sys.argv[1:]
open(__file__ + ".log", "a").write(json.dumps(a) + "\\n")
get = lambda flag: int(a[a.index(flag) + 1])
p, n, d = get("-p"), get("-n"), get("-d")
tests = ([{"n_prompt": p, "n_gen": 0, "n_depth": d, "avg_ts": 1000.0 + p}] if p else []) + \\
        ([{"n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": 100.0 + d / 1000}] if n else [])
print(json.dumps(tests))
"""


@pytest.fixture
def fake_llama(tmp_path):
    exe = tmp_path / "bin" / "llama-bench"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\n" + FAKE_BENCH)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def _calls(exe) -> list[list[str]]:
    return [json.loads(line) for line in exe.with_name("llama-bench.log").read_text().splitlines()]


def test_llama_run_after_a_depth_fills_it_once_for_both_tests(fake_llama, tiny_llama_dir):
    from bench.llamacpp import llama_run

    row = llama_run(str(fake_llama.parent), "llama.cpp", str(tiny_llama_dir), 512, 32, depth=16384)
    [call] = _calls(fake_llama)  # one llama-bench: its prompt and generation tests share the fill
    assert call[call.index("-d") + 1] == "16384" and call[call.index("-p") + 1] == "512"
    assert row["prefill_tps"] == 1512.0 and row["decode_tps"] == 100.0 + 16.384
    assert row["decode_depth"] == 16384 and row["prefill_depth"] == 16384 and row["read_bytes"] > 0
    # without a depth: the prompt from none, the decode after the prompt's context (two runs)
    row = llama_run(str(fake_llama.parent), "llama.cpp", str(tiny_llama_dir), 1024, 32)
    pp, tg = _calls(fake_llama)[1:]
    assert (pp[pp.index("-p") + 1], pp[pp.index("-d") + 1]) == ("1024", "0")
    assert (tg[tg.index("-n") + 1], tg[tg.index("-d") + 1]) == ("32", "1024")
    assert row["prefill_tps"] == 2024.0 and row["decode_tps"] == 101.024 and "error" not in row
    # decode only (--synthetic): no prompt test run at all
    row = llama_run(str(fake_llama.parent), "llama.cpp", str(tiny_llama_dir), 4096, 8, prefill=False)
    assert _calls(fake_llama)[3][_calls(fake_llama)[3].index("-p") + 1] == "0" and row["prefill_tps"] is None
    missing = llama_run(str(fake_llama.parent / "nowhere"), "llama.cpp", str(tiny_llama_dir), 16, 8)
    assert "llama-bench failed" in missing["error"]


def test_speed_rounds_alternate_and_ratios_are_per_round_medians(monkeypatch, tmp_path):
    """Each round runs every system once before the next (the order turned a step each
    round); a row is the median with its min and max, never the best; a ratio pairs the
    runs of one round and reports the median and range of those ratios."""
    import bench.common
    import bench.floor
    import bench.speed as speed

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    monkeypatch.setattr(bench.floor, "read_bandwidth", lambda: 10e9)
    order, rates = [], {"justfit-nodraft": [50.0, 60.0, 90.0], "llama.cpp": [100.0, 50.0, 100.0]}

    def one(system, context, args):
        order.append(system)
        n = sum(1 for s in order if s == system) - 1
        return {"prefill_tps": 10.0 * (n + 1), "decode_tps": rates[system][n], "ttft_s": 1.0}

    monkeypatch.setattr(speed, "_one", one)
    result = speed.main(["--model", "smollm2", "--systems", "justfit-nodraft", "--contexts", "16", "--repeat", "3",
                         "--llama-cpp", "DIR", "--llama-systems", "llama.cpp", "--json"])
    assert order == ["justfit-nodraft", "llama.cpp", "llama.cpp", "justfit-nodraft", "justfit-nodraft", "llama.cpp"]
    rows = {r["system"]: r for r in result["systems"]}
    jf = rows["justfit-nodraft"]
    assert (jf["decode_tps"], jf["decode_tps_min"], jf["decode_tps_max"], jf["runs"]) == (60.0, 50.0, 90.0, 3)
    assert not any(k.endswith("_best") for k in jf)
    [decode] = [q for q in result["ratios"] if q["rate"] == "decode_tps"]
    assert decode["each"] == [0.5, 1.2, 0.9] and decode["median"] == 0.9  # not 90 / 100 nor 60 / 100
    assert (decode["min"], decode["max"], decode["n"]) == (0.5, 1.2, 3)
    assert result["settings"]["rounds"] == 3
    md = next(p for p in tmp_path.iterdir() if p.suffix == ".md").read_text()
    assert "60.00 (50.00-90.00)" in md
    assert "| justfit-nodraft / llama.cpp | 16 | decode_tps | 0.900 | 0.500-1.200 | 3 |" in md


def test_speed_after_a_depth_prefills_the_prompt_alone_with_drafts_off(tiny_llama_dir, fake_llama, tmp_path,
                                                                      monkeypatch):
    """--depth: JustFit holds DEPTH random positions, prefills CONTEXT tokens after them
    (those alone computed) and decodes after DEPTH; drafts off in justfit-nodraft; the
    ratio to llama-bench at the same depth is in the result."""
    import bench.common
    from bench.speed import main as speed

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    with pytest.raises(SystemExit):  # stock mlx-lm holds no random state
        speed(["--model", str(tiny_llama_dir), "--systems", "mlx-lm", "--depth", "64"])
    result = speed(["--model", str(tiny_llama_dir), "--systems", "justfit-nodraft", "--contexts", "16",
                    "--depth", "96", "--decode", "4", "--llama-cpp", str(fake_llama.parent),
                    "--llama-systems", "llama.cpp", "--json"])
    rows = {r["system"]: r for r in result["systems"]}
    jf = rows["justfit-nodraft"]
    assert "error" not in jf, jf
    assert jf["prefill_tokens"] == 16 and jf["depth"] == 96 and jf["drafts"] == "none"
    assert jf["prefill_tps"] > 0 and jf["decode_tps"] > 0 and "drafted_tokens" not in jf
    assert rows["llama.cpp"]["decode_depth"] == 96 and rows["llama.cpp"]["prefill_tps"] == 1016.0
    assert {q["rate"] for q in result["ratios"]} == {"prefill_tps", "decode_tps"}


def test_streams_share_one_justfit_server_and_alternate_rounds(monkeypatch, tmp_path):
    """justfit-nodraft and justfit-drafts are one `justfit serve` (the request's
    `speculate` false / true), llama-server rows send none; every server is up before
    round 1, each round measures every row once; ratios pair one round's two figures."""
    import contextlib

    import bench.common
    import bench.streams as streams
    from bench.speculation import Reply

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    started, sent = [], []

    @contextlib.asynccontextmanager
    async def running(server):
        started.append((server.process, server.command(8080)[:3]))
        yield f"http://{server.process}"

    async def chat(http, url, messages, max_tokens, speculate, timeout, extra=None):
        sent.append((url, speculate, max_tokens, extra))
        r = 50.0 + len(sent)  # a decode rate that differs with every request
        return Reply(text="x", completion_tokens=max_tokens, prompt_tokens=20, total_s=1.0 + (max_tokens - 1) / r,
                     first_s=1.0, drafted=4 if speculate else None, accepted=2 if speculate else None)

    monkeypatch.setattr(streams, "running", running)
    monkeypatch.setattr(streams, "chat", chat)
    streams.main(["--systems", "justfit-nodraft,justfit-drafts,llama-server-np1", "--rounds", "3",
                  "--llama-cpp", str(tmp_path)])
    assert [p for p, _ in started] == ["justfit", "llama-server-np1"]  # one justfit serve for both rows
    assert "--draft" not in started[0][1] and started[0][1][1] == "serve"
    assert {s for u, s, _, _ in sent if u == "http://justfit"} == {False, True}
    assert {s for u, s, _, _ in sent if u != "http://justfit"} == {None}
    assert all(e == {"ignore_eos": True} for *_, e in sent)
    result = json.loads(next(tmp_path.glob("streams-*.json")).read_text())
    rows = {r["system"]: r for r in result["systems"]}
    assert result["settings"]["max_tokens"] == 96 and all(len(r["rounds"]) == 3 for r in rows.values())
    assert rows["justfit-nodraft"]["speculate"] is False and rows["justfit-drafts"]["rounds"][0]["accepted"]
    assert "accepted" not in rows["justfit-nodraft"]["rounds"][0]
    single = next(q for q in result["ratios"] if (q["system"], q["over"], q["rate"])
                  == ("justfit-nodraft", "llama-server-np1", "single_tps"))
    assert single["n"] == 3 and single["min"] <= single["median"] <= single["max"]
    assert len(set(single["each"])) > 1  # one ratio per round, not one of two medians
