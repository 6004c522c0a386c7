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
                     first_s=1.0, drafted=None if speculate is None else 4 * speculate,
                     accepted=None if speculate is None else 2 * speculate)  # JustFit reports 0 with drafts off

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
    assert set(rows["justfit-nodraft"]["rounds"][0]["drafted"]) == {0}  # drafts off: none drafted
    assert "accepted" not in rows["llama-server-np1"]["rounds"][0] and rows["llama-server-np1"]["slots"] == 1
    single = next(q for q in result["ratios"] if (q["system"], q["over"], q["rate"])
                  == ("justfit-nodraft", "llama-server-np1", "single_tps"))
    assert single["n"] == 3 and single["min"] <= single["median"] <= single["max"]
    assert len(set(single["each"])) > 1  # one ratio per round, not one of two medians


def _speed_result(contexts, depth, rates):
    """A bench.speed result of three rounds: rates[(system, context)] = decode rates."""
    from bench.speed import ratios, spread

    runs = {k: [{"decode_tps": d, "prefill_tps": 10 * d} for d in v] for k, v in rates.items()}
    rows = []
    for (system, context), rs in runs.items():
        row = {"system": system, "context": context, "runs": len(rs)}
        for key in ("decode_tps", "prefill_tps"):
            got = spread([r[key] for r in rs])
            row[key], row[f"{key}_min"], row[f"{key}_max"] = got["median"], got["min"], got["max"]
        rows.append(row)
    systems = sorted({s for s, _ in rates if s.startswith("justfit")})
    return {"settings": {"contexts": contexts, "depth": depth}, "systems": rows,
            "ratios": ratios(runs, contexts, systems, ["llama.cpp"])}


def test_the_sitting_gives_the_speed_rows_medians_with_ranges(tmp_path, monkeypatch):
    """With SITTING named, the speed rows come from its manifest's files: drafts off and
    drafts on as rows of their own, every figure a median with its range, every ratio the
    median (range) of each round's pair, the rerun column the step's command."""
    from bench import summary

    names = ("justfit-nodraft", "justfit-drafts", "llama.cpp")
    speed = _speed_result([16, 1024], 0, {(s, c): [90.0 + i, 80.0 + 2 * i, 100.0 - i] for c in (16, 1024)
                                          for i, s in enumerate(names)})
    depth = _speed_result([512], 16384, {(s, 512): [30.0 + i, 28.0, 33.0] for i, s in enumerate(names)})
    stream_rows = []
    for i, s in enumerate(("justfit-nodraft", "justfit-drafts", "llama-server-np1", "llama-server-np4")):
        rounds = [{"single_tps": 90.0 + i + r, "aggregate_tps": 150.0 - i - r, "prompt_tokens": 21} for r in range(3)]
        stream_rows.append({"system": s, "rounds": rounds, "single_tps": 91.0 + i, "single_tps_min": 90.0 + i,
                            "single_tps_max": 92.0 + i, "aggregate_tps": 149.0 - i, "aggregate_tps_min": 148.0 - i,
                            "aggregate_tps_max": 150.0 - i})
    from bench.streams import ratios as stream_ratios

    streams = {"settings": {"streams": 4, "max_tokens": 96, "rounds": 3}, "systems": stream_rows,
               "ratios": stream_ratios(stream_rows)}
    stems = {"speed": "speed-20990101-000001", "speed_depth": "speed-20990101-000002",
             "streams": "streams-20990101-000003"}
    for key, data in (("speed", speed), ("speed_depth", depth), ("streams", streams)):
        (tmp_path / f"{stems[key]}.json").write_text(json.dumps(data))
    steps = {k: {"command": f"python -m bench.{k.split('_')[0]} --llama-cpp /some/where/bin --x", "result": v}
             for k, v in stems.items()}
    (tmp_path / "sitting-20990101-000004.json").write_text(json.dumps(
        {"settings": {"rounds": 3}, "steps": steps, "files": stems}))
    monkeypatch.setattr(summary, "SITTING", "sitting-20990101-000004")
    off, on, prefill, served_off, served_on = summary.sitting_rows(tmp_path)
    assert "drafts off" in off.what and "drafts on" in on.what and "16 / 1,024 / 16,384 positions" in off.what
    assert "3 alternating rounds" in off.what
    # medians (ranges) per context; the ratio of each round's pair: 90/92, 80/84, 100/98 -> median 0.95
    assert off.justfit.startswith("90.0 (80.0-100.0) / 90.0 (80.0-100.0) / 30.0 (28.0-33.0)")
    assert "(JustFit 0.98x (0.95-1.02x)" in off.baseline and "llama-bench" in off.baseline
    assert off.sources == ("sitting-20990101-000004", stems["speed"], stems["speed_depth"])
    assert "--llama-cpp DIR" in off.command and "/some/where" not in off.command
    assert "1,024 tokens / 512 tokens after 16,384" in prefill.what
    assert "`\"speculate\": false`" in served_off.justfit and "21-token prompt" in served_off.what
    assert served_on.sources == ("sitting-20990101-000004", stems["streams"]) and "flatters" in served_on.justfit
    # the same rounds' pairs: (90 + r) / (92 + r) for r = 0, 1, 2 -> median 91 / 93
    assert f"JustFit {91 / 93:.2f}x ({90 / 92:.2f}-{92 / 94:.2f}x)" in served_off.baseline
