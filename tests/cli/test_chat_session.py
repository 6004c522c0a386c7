"""`justfit chat`'s interactive session, driven through ChatSession with scripted
lines, on the real SmolLM2 135M: multi-line input, kept state between turns, slash
commands, errors and Ctrl-C that keep the session, the prefill bar and stats line."""

from __future__ import annotations

import io
import json
import os
import signal

import pytest

from cli.chat_session import ChatSession, PrefillBar, stats_line
from cli.terminal import deferred_sigint
from justfit import Engine, SamplingParams

QUESTION = "What is the capital of France?"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()  # the embedded SmolLM2 135M


def session(engine, lines, **kw) -> tuple[ChatSession, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    kw.setdefault("sampling", GREEDY)
    engine.reset()
    return ChatSession(engine, lines, out, err, **kw), out, err


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
    stats = s.last_stats  # the last turn's, from its last chunk
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
    assert s.last_stats.cached_tokens == 0
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
    assert s.last_stats.cached_tokens == 0  # the new system prompt was prefilled


def test_stats_command(engine):
    s, out, err = session(engine, ["/stats", QUESTION, "/stats"])  # a new session: no request yet
    s.run()
    report = err.getvalue()
    assert "last request: none yet" in report
    assert f"BLAS {engine.blas}" in report and f"policy {engine.policy.name}" in report
    assert f"last request: {s.last_stats.summary()}" in report
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
    assert t.last_stats.cached_tokens == 0
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
    assert t.last_stats.cached_tokens >= len(kept) - 1
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
    assert s.last_stats.cached_tokens > 0
    assert "Paris" in s.messages[3]["content"]


def test_ctrl_c_twice_interrupts_at_once_unless_the_ranks_must_finish_the_step():
    """One process: a second Ctrl-C raises at once. A layer pipeline (at_once=False):
    every press only asks to stop, so rank 0 never leaves a forward midway."""
    asked = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint(lambda: asked.append("stop")):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    assert asked == ["stop"]
    with deferred_sigint(lambda: asked.append("again"), at_once=False):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    assert asked == ["stop", "again", "again"]


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
    reply = engine.reply([{"role": "user", "content": QUESTION}], GREEDY)
    assert "Paris" in reply.text
    s = reply.stats
    line = stats_line(s)
    assert f"{s.generated_tokens} tokens at" in line and "tok/s" in line and "peak" in line


def test_loader_notes_show_the_loaders_messages_while_loading_only():
    import logging

    from cli.terminal import loader_notes

    logger = logging.getLogger("justfit.loader")
    level, handlers = logger.level, list(logger.handlers)
    stream = io.StringIO()
    with loader_notes(stream):
        logger.info("measuring something")
    logger.info("after loading")
    assert "measuring something..." in stream.getvalue() and "after loading" not in stream.getvalue()
    assert logger.level == level and logger.handlers == handlers
