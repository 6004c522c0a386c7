"""Base models (no chat template) behave as users expect, on a tiny random llama whose
tokenizer carries no template: chat continues raw text and reuses its state turn to
turn, `justfit generate` prints exactly the continuation, the server's chat routes
answer 400 pointing to the completion routes, and a given template file applies."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import common
from cli.chat_session import ChatSession
from cli.main import main
from justfit import Engine, SamplingParams
from justfit.model.chat_template import ChatTemplateError, has_chat_template, read_chat_template, use_chat_template

GREEDY = SamplingParams(temperature=0, max_tokens=5)
NOTICE = "is a base model with no chat template: text is continued as typed"
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def without_template(source: Path, dest: Path) -> Path:
    """A copy of a tiny model folder whose tokenizer has no chat template (a base model)."""
    shutil.copytree(source, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def base_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return without_template(tiny_llama_dir, tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="module")
def base_engine(base_dir) -> Engine:
    return Engine(str(base_dir))


@pytest.fixture
def uses(monkeypatch):
    """Make the CLI load `engine` (fresh state) instead of reading a model."""
    def use(engine: Engine) -> Engine:
        engine.reset()
        monkeypatch.setattr(common, "load_engine", lambda *a, **k: engine)
        return engine
    return use


def text_of(engine: Engine) -> str:
    return engine.tokenizer.decode(engine.cached_tokens)


# -- the helper --------------------------------------------------------------------


def test_has_chat_template_and_clear_errors_for_bad_template_files(base_engine, tiny_llama_dir, tmp_path):
    assert not has_chat_template(base_engine.tokenizer)
    assert has_chat_template(Engine(str(tiny_llama_dir)).tokenizer)
    cases = {"missing.jinja": (None, "cannot read chat template"),
             "empty.jinja": ("  \n", "is empty"),
             "syntax.jinja": ("{% for m in messages %}\n{{ m['content'] }", "(line 2)"),
             "ignores.jinja": ("hello", "does not render the messages")}
    for name, (text, needle) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ChatTemplateError, match=re.escape(needle)):
            use_chat_template(base_engine.tokenizer, read_chat_template(path), f"chat template {path}")
    assert not has_chat_template(base_engine.tokenizer)  # nothing was installed


# -- chat --------------------------------------------------------------------------


def test_raw_chat_continues_the_text_and_reuses_state_across_turns(base_engine):
    base_engine.reset()
    out, err = io.StringIO(), io.StringIO()
    s = ChatSession(base_engine, ["the cat", "sat on"], out, err, sampling=GREEDY, raw=True)
    s.handle(s.read_input())
    first = s.last_stats
    assert first.prompt_tokens == len(base_engine.encode("the cat"))  # the text as typed, nothing around it
    s.handle(s.read_input())
    second = s.last_stats
    # Turn 2 starts with exactly what turn 1 computed: only the new line is prefilled.
    new_line = base_engine.tokenizer.encode("\nsat on", add_special_tokens=False)
    assert second.prompt_tokens == first.prompt_tokens + first.generated_tokens + len(new_line)
    assert second.cached_tokens >= first.prompt_tokens + first.generated_tokens - 1
    assert second.prompt_tokens - second.cached_tokens <= len(new_line) + 1
    assert f"({second.cached_tokens} cached)" in err.getvalue()
    text = text_of(base_engine)
    assert text.startswith("the cat") and "\nsat on" in text and "<|im_start|>" not in text
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 2


def test_raw_transcript_loads_back_as_one_text(base_engine, tmp_path):
    base_engine.reset()
    s = ChatSession(base_engine, ["the cat"], io.StringIO(), sampling=GREEDY, raw=True, system="A story.")
    s.handle(s.read_input())
    s.save(tmp_path / "t.json")
    resumed = ChatSession(base_engine, ["sat on"], io.StringIO(), sampling=GREEDY, raw=True)
    resumed.load_any(tmp_path / "t.json")
    resumed.handle(resumed.read_input())
    text = text_of(base_engine)
    assert text.startswith("A story.\n\nthe cat") and "\nsat on" in text
    assert resumed.last_stats.cached_tokens >= len(base_engine.encode("A story.\n\nthe cat"))


def test_piped_chat_on_a_base_model_says_so_once_and_prints_the_continuation(base_engine, uses):
    engine = uses(base_engine)
    result = CliRunner().invoke(main, ["chat", "-t", "0", "--max-tokens", "5"], input="the cat\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count(NOTICE) == 1
    engine.reset()
    assert result.stdout == engine.complete("the cat", GREEDY) + "\n"  # just the answer


def test_raw_flag_skips_a_models_template(tiny_llama_dir, uses):
    engine = uses(Engine(str(tiny_llama_dir)))
    result = CliRunner().invoke(main, ["chat", "--raw", "-t", "0", "--max-tokens", "3"], input="the cat\n")
    assert result.exit_code == 0, result.output
    assert text_of(engine).startswith("the cat") and "<|im_start|>" not in text_of(engine)
    assert result.stderr == ""  # asked for: nothing to say when piped
    both = CliRunner().invoke(main, ["chat", "--raw", "--chat-template", "x.jinja"], input="hi\n")
    assert both.exit_code == 2 and "exclude each other" in both.output


def test_template_option_applies_the_given_template(base_dir, uses, tmp_path):
    engine = uses(Engine(str(base_dir)))  # its own: the template is installed on its tokenizer
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    result = CliRunner().invoke(main, ["chat", "--chat-template", str(path), "-t", "0", "--max-tokens", "3"],
                                input="the cat\n")
    assert result.exit_code == 0, result.output
    assert text_of(engine).startswith("<<user>>the cat\n<<assistant>>") and NOTICE not in result.stderr
    engine.reset()  # the old spelling still works, and says once what to write instead
    result = CliRunner().invoke(main, ["chat", "--template", str(path), "-t", "0", "--max-tokens", "3"],
                                input="the cat\n")
    assert result.exit_code == 0, result.output
    assert text_of(engine).startswith("<<user>>the cat\n<<assistant>>")
    assert result.stderr == "warning: --template is deprecated; use --chat-template\n"
    strict = tmp_path / "strict.jinja"  # renders one question, refuses a system prompt
    strict.write_text("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                      + TEMPLATE)
    result = CliRunner().invoke(main, ["chat", "--chat-template", str(strict), "--system", "Be brief."],
                                input="hi\n")
    assert result.exit_code == 1 and "rejected the conversation: no system role" in result.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    result = CliRunner().invoke(main, ["chat", "--chat-template", str(bad)], input="hi\n")
    assert result.exit_code == 1 and result.stderr.startswith(f"error: chat template {bad} is not a usable")
    result = CliRunner().invoke(main, ["serve", "--chat-template", str(tmp_path / "none.jinja")])
    assert result.exit_code == 1 and "cannot read chat template" in result.stderr


# -- generate ----------------------------------------------------------------------


def test_generate_prints_exactly_the_continuation(base_engine, uses):
    engine = uses(base_engine)
    args = ["generate", "-t", "0", "--max-tokens", "5"]
    given = CliRunner().invoke(main, [*args, "--prompt", "the cat"])
    assert given.exit_code == 0, given.output
    engine.reset()
    assert given.stdout == engine.complete("the cat", GREEDY) and given.stdout
    assert given.stderr == ""
    engine.reset()
    piped = CliRunner().invoke(main, [*args, "--stats"], input="the cat\n")  # echo's newline is dropped
    assert piped.exit_code == 0 and piped.stdout == given.stdout
    assert "phase prefill" in piped.stderr and "phase decode" in piped.stderr
    empty = CliRunner().invoke(main, args, input="\n")
    assert empty.exit_code == 1 and empty.stderr == "error: nothing to continue: the prompt is empty\n"


# -- the server --------------------------------------------------------------------


def test_server_refuses_chat_without_a_template_and_says_where_to_go(base_dir):
    from tests.server.test_server import LiveServer, request

    engine = Engine(str(base_dir))
    live = LiveServer(engine)
    try:
        chat = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 3, "temperature": 0}
        status, _, text = request(live, "POST", "/v1/chat/completions", chat)
        err = json.loads(text)["error"]
        assert status == 400 and err["code"] == "no_chat_template"
        assert "/v1/completions" in err["message"] and "--chat-template FILE" in err["message"]
        status, _, text = request(live, "POST", "/api/chat", {**chat, "stream": False})
        assert status == 400 and "/api/generate" in json.loads(text)["error"]
        status, _, text = request(live, "POST", "/v1/completions", {"prompt": "the cat", "max_tokens": 3})
        assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == len(engine.encode("the cat"))
        status, _, text = request(live, "POST", "/api/generate", {"prompt": "the cat", "stream": False,
                                                                  "options": {"num_predict": 3}})
        assert status == 200 and json.loads(text)["context"][:len(engine.encode("the cat"))] == engine.encode("the cat")
        assert json.loads(request(live, "GET", "/v1/models")[2])["data"][0]["has_chat_template"] is False
        assert json.loads(request(live, "POST", "/api/show", {})[2])["has_chat_template"] is False
        use_chat_template(engine.tokenizer, TEMPLATE)  # what `serve --chat-template FILE` does
        status, _, text = request(live, "POST", "/v1/chat/completions", chat)
        assert status == 200 and text_of(engine).startswith("<<user>>the cat\n<<assistant>>")
        assert json.loads(request(live, "GET", "/v1/models")[2])["data"][0]["has_chat_template"] is True
    finally:
        live.close()
