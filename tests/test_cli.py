"""The `justfit` command line: the group, `justfit chat` piped and interactive
(driven through ChatSession with scripted lines), on the real SmolLM2 135M."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import justfit  # noqa: F401  (preloads OpenBLAS before mlx is imported)
import pytest
from click.testing import CliRunner

from cli import common
from cli.chat import ChatSession, PrefillBar, stats_line
from cli.main import main
from justfit import Engine, SamplingParams
from justfit.models import ModelNotFound

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()  # the embedded SmolLM2 135M


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def loads(engine, monkeypatch) -> list:
    """Make `justfit chat` use the shared engine (honouring --budget); records the
    (model, budget) each command asked for."""
    calls: list = []

    def load(model, budget, gguf_bits="native", kv_format="q8c", policy="auto", whole_process=False):
        calls.append((model, budget, whole_process) if whole_process else (model, budget))
        monkeypatch.setattr(engine.config, "budget_bytes", budget)
        return engine

    monkeypatch.setattr(common, "load_engine", load)
    engine.reset()
    return calls


def session(engine, lines, **kw) -> tuple[ChatSession, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("sampling", GREEDY)
    engine.reset()
    return ChatSession(engine, lines, out, err, **kw), out, err


def assert_one_error_line(result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


# -- the group ---------------------------------------------------------------------


def test_help_lists_chat(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "chat" in result.output and "JUSTFIT_DEBUG" in result.output
    result = runner.invoke(main, ["chat", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--max-tokens", "--temperature", "--top-p", "--seed",
                   "--system", "--budget"):
        assert option in result.output


def test_serve_command_starts_answers_and_stops(tiny_llama_dir):
    import json
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", str(tiny_llama_dir), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            if line.startswith("serving"):
                url = line.split(" on ")[1].split("/v1")[0]
                break
        assert url, "server did not start"
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["prompt_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_version(runner):
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"justfit, version {justfit.__version__}"


# -- piped chat --------------------------------------------------------------------


def test_piped_chat_answers_paris(runner, loads):
    result = runner.invoke(main, ["chat", "--temperature", "0", "--max-tokens", "20"],
                           input=QUESTION + "\n")
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    assert result.stdout.endswith("\n") and "tok/s" not in result.stdout  # only the reply
    assert result.stderr == ""
    assert loads == [(None, None)]


def test_piped_chat_with_system_prompt(runner, loads, engine):
    result = runner.invoke(main, ["chat", "-t", "0", "--max-tokens", "4", "--system",
                                  "You are Zorblax."], input="Hi\n")
    assert result.exit_code == 0, result.output
    assert "You are Zorblax." in engine.tokenizer.decode(engine.cached_tokens)


def test_missing_model_is_one_error_line(runner, tmp_path):
    missing = tmp_path / "missing.gguf"
    result = runner.invoke(main, ["chat", "--model", str(missing)], input="hi\n")
    assert_one_error_line(result, "no such model file", str(missing))
    assert isinstance(result.exception, SystemExit)


def test_unknown_model_name_is_one_error_line(runner):
    result = runner.invoke(main, ["chat", "--model", "no-such-model"], input="hi\n")
    assert_one_error_line(result, "no such model: no-such-model", "smollm2")


def test_debug_env_reraises(runner, tmp_path):
    result = runner.invoke(main, ["chat", "--model", str(tmp_path / "x.gguf")], input="hi\n",
                           env={"JUSTFIT_DEBUG": "1"})
    assert result.exit_code == 1
    assert isinstance(result.exception, ModelNotFound)


def test_prompt_too_long_is_one_error_line(runner, loads, engine):
    result = runner.invoke(main, ["chat", "--max-tokens", "100000"], input=QUESTION + "\n")
    assert_one_error_line(result, "prompt too long", "100000", str(engine.context_limit))
    assert result.stdout == ""


def test_budget_exceeded_is_one_error_line(runner, loads):
    result = runner.invoke(main, ["chat", "--budget", "1MiB"], input=QUESTION + "\n")
    assert_one_error_line(result, "does not fit the memory budget", "--budget")
    assert loads == [(None, 2**20)]


def test_whole_process_flag_reaches_the_engine(runner, loads):
    result = runner.invoke(main, ["chat", "--budget", "1MiB", "--whole-process"], input=QUESTION + "\n")
    assert result.exit_code != 0 and loads == [(None, 2**20, True)]


def test_bad_budget_is_a_usage_error_before_loading(runner, loads):
    result = runner.invoke(main, ["chat", "--budget", "lots"], input="hi\n")
    assert result.exit_code == 2
    assert "not a memory size" in result.output
    assert loads == []


def test_empty_stdin_is_an_error(runner, loads):
    result = runner.invoke(main, ["chat"], input="  \n")
    assert_one_error_line(result, "stdin was empty")
    assert loads == []


def test_piped_chat_in_a_subprocess():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "chat", "--temperature", "0", "--max-tokens", "20"],
        input=QUESTION + "\n", capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr


# -- the interactive session ---------------------------------------------------------


def test_multiline_input_is_one_message():
    lines = ["first \\", "second \\", "third", '"""', "block one", "", "block two", '"""',
             '"""inline"""', '"""opened', 'closed"""', "plain"]
    s = ChatSession(None, lines, io.StringIO())
    assert s.read_input() == "first \nsecond \nthird"
    assert s.read_input() == "block one\n\nblock two"
    assert s.read_input() == "inline"
    assert s.read_input() == "opened\nclosed"
    assert s.read_input() == "plain"
    with pytest.raises(EOFError):
        s.read_input()


def test_multiline_turns_reach_the_model(engine):
    s, out, err = session(engine, ["Say hello \\", "in French.", '"""', "Now in", "German.",
                                   '"""'])
    s.run()
    user = [m["content"] for m in s.messages if m["role"] == "user"]
    assert user == ["Say hello \nin French.", "Now in\nGerman."]
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 2
    text = engine.tokenizer.decode(engine.cached_tokens)
    assert "Say hello \nin French." in text and "Now in\nGerman." in text
    assert "tok/s" in err.getvalue() and "peak" in err.getvalue()


def test_second_turn_reuses_the_kept_state(engine):
    s, out, err = session(engine, [QUESTION, "And of Germany?"])
    s.run()
    assert "Paris" in s.messages[1]["content"]
    stats = engine.last_stats
    assert stats.cached_tokens > 0
    assert stats.prompt_tokens - stats.cached_tokens < 30  # only the new turn was prefilled
    assert "Paris" in out.getvalue()
    assert f"({stats.cached_tokens} cached)" in err.getvalue()


def test_reset_forgets_the_conversation(engine):
    s, out, err = session(engine, [QUESTION, "/reset", "And of Germany?"])
    s.handle(s.read_input())
    assert len(s.messages) == 2 and engine.cached_tokens
    s.handle(s.read_input())
    assert s.messages == [] and engine.cached_tokens == []
    assert "conversation cleared" in err.getvalue()
    s.handle(s.read_input())
    assert engine.last_stats.cached_tokens == 0
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["And of Germany?"]


def test_system_command_sets_prompt_and_starts_over(engine):
    s, out, err = session(engine, [QUESTION, "/system You are a pirate named Zorblax.",
                                   "/system", "Hello!"])
    s.run()
    assert s.system == "You are a pirate named Zorblax."
    assert [m["content"] for m in s.messages if m["role"] == "user"] == ["Hello!"]
    text = engine.tokenizer.decode(engine.cached_tokens)
    assert "You are a pirate named Zorblax." in text and QUESTION not in text
    assert "system prompt: 'You are a pirate named Zorblax.'" in err.getvalue()
    assert engine.last_stats.cached_tokens == 0  # the new system prompt was prefilled


def test_stats_command(engine):
    s, out, err = session(engine, ["/stats", QUESTION, "/stats"])
    engine.last_stats = None  # as in a fresh process
    s.run()
    report = err.getvalue()
    assert "last request: none yet" in report
    assert f"BLAS {engine.blas}" in report and f"policy {engine.policy.name}" in report
    assert f"last request: {engine.last_stats.summary()}" in report
    assert "memory: weights" in report and "MLX peak" in report
    assert "phase prefill: " in report and "phase decode: " in report and "components resident" in report
    assert f"of {engine.context_limit} context" in report


def test_save_and_load_round_trip(engine, tmp_path):
    path = tmp_path / "chat.json"
    s, out, err = session(engine, [QUESTION, f"/save {path}"], system="Be brief.")
    s.run()
    saved = json.loads(path.read_text())
    assert saved == {"model": engine.name, "system": "Be brief.", "messages": s.messages}
    assert saved["messages"][0] == {"role": "user", "content": QUESTION}

    t, out2, err2 = session(engine, [f"/load {path}", "And of Germany?"])
    t.handle(t.read_input())
    assert t.system == "Be brief." and t.messages == s.messages
    assert f"loaded 2 messages from {path}" in err2.getvalue()
    t.handle(t.read_input())
    # The next turn prefilled the loaded conversation (the engine had been reset).
    assert engine.last_stats.cached_tokens == 0
    text = engine.tokenizer.decode(engine.cached_tokens)
    assert "Be brief." in text and QUESTION in text and "And of Germany?" in text
    assert len(t.messages) == 4


def test_save_and_load_state_resumes_without_recomputing(engine, tmp_path):
    path = tmp_path / "chat-state"
    s, out, err = session(engine, [QUESTION, f"/save {path}"], system="Be brief.")
    s.run()
    assert (path / "manifest.json").is_file() and "the state of" in err.getvalue()
    kept = engine.cached_tokens
    engine.reset()  # as in a new process

    t, out2, err2 = session(engine, [f"/load {path}", "And of Germany?"])
    t.handle(t.read_input())
    assert t.system == "Be brief." and t.messages == s.messages
    assert engine.cached_tokens == kept and f"resumed 2 messages ({len(kept)} tokens of state)" in err2.getvalue()
    t.handle(t.read_input())
    # Only the new turn was prefilled: everything before it came from the state.
    assert engine.last_stats.cached_tokens >= len(kept) - 1
    assert len(t.messages) == 4


def test_bad_commands_keep_the_session(engine, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "wizard", "content": "x"}]}')
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{")
    s, out, err = session(engine, ["/frobnicate", f"/load {bad}", f"/load {tmp_path / 'nope'}",
                                   f"/load {damaged}", "/save", f"/save {tmp_path / 'st'}", "/help",
                                   "/quit", "never read"])
    s.run()
    lines = err.getvalue().splitlines()
    assert "error: unknown command /frobnicate; /help lists them" in lines
    assert any(l.startswith(f"error: cannot load {bad}: message 0 needs a role") for l in lines)
    assert any(l.startswith(f"error: cannot load {tmp_path / 'nope'}:") for l in lines)
    assert any(l.startswith(f"error: cannot load {damaged}: ") and "damaged manifest" in l for l in lines)
    assert "error: usage: /save NAME" in lines
    assert f"error: cannot save {tmp_path / 'st'}: nothing to save: the conversation holds no state yet" in lines
    assert any("/system [TEXT]" in l for l in lines)
    assert s.messages == [] and out.getvalue() == ""  # /quit stopped before "never read"


def test_engine_refusal_keeps_the_session(engine):
    s, out, err = session(engine, [QUESTION], sampling=SamplingParams(max_tokens=100000))
    s.run()
    assert "error: prompt too long" in err.getvalue()
    assert s.messages == []
    s.sampling = GREEDY
    assert "Paris" in s.ask(QUESTION)


def test_ctrl_c_stops_the_reply_but_keeps_the_session(engine):
    class InterruptingOut(io.StringIO):
        """Presses Ctrl-C when the first reply has streamed a few pieces."""
        writes = 0

        def write(self, text):
            InterruptingOut.writes += 1
            if InterruptingOut.writes == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return super().write(text)

    out, err = InterruptingOut(), io.StringIO()
    engine.reset()
    s = ChatSession(engine, ["Write a long story about a dragon.", QUESTION], out, err,
                    sampling=SamplingParams(temperature=0, max_tokens=200))
    handler = signal.getsignal(signal.SIGINT)
    s.run()
    assert signal.getsignal(signal.SIGINT) is handler  # restored after each reply
    assert "[interrupted]" in err.getvalue()
    first = s.messages[1]["content"]
    assert s.messages[1]["role"] == "assistant" and 0 < len(first) < 100
    # The kept state held the partial reply, so the next turn only prefilled the new part.
    assert engine.last_stats.cached_tokens > 0
    assert "Paris" in s.messages[3]["content"]


def test_prefill_bar_only_for_long_new_prompts():
    stream = io.StringIO()
    bar = PrefillBar(stream, enabled=True, min_tokens=256)
    for done in (1000, 1100, 1200):  # 1000 cached, 200 new: no bar
        bar(done, 1200)
    assert stream.getvalue() == ""
    bar = PrefillBar(stream, enabled=True, min_tokens=256)
    for done in (100, 612, 1100):
        bar(done, 1100)
    shown = stream.getvalue()
    assert "512/1000 tokens" in shown and "1000/1000 tokens" in shown
    bar.clear()
    assert stream.getvalue().endswith("\r\x1b[K")
    quiet = io.StringIO()
    off = PrefillBar(quiet, enabled=False, min_tokens=0)
    off(0, 5000), off(5000, 5000)
    assert quiet.getvalue() == ""


def test_stats_line_after_a_reply(engine):
    engine.reset()
    assert "Paris" in engine.complete([{"role": "user", "content": QUESTION}], GREEDY)
    line = stats_line(engine)
    s = engine.last_stats
    assert f"{s.generated_tokens} tokens at" in line and "tok/s" in line and "peak" in line


def test_bench_runs_a_suite_through_the_cli(tmp_path, monkeypatch):
    import bench.common

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    result = CliRunner().invoke(main, ["bench", "kv", "bytes", "--context", "1024"])
    assert result.exit_code == 0, result.output
    assert '"format": "q8c"' in result.output and list(tmp_path.glob("kv-bytes-*.json"))
    bad = CliRunner().invoke(main, ["bench", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output

