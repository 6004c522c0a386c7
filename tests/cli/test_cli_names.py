"""One name per option across the commands: old spellings hidden, still working, warned
about once (chat's old --template: test_base_models.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from cli import common
from cli.main import main
from justfit.engine.runner import LocalRunner


@pytest.fixture
def serve_ports(monkeypatch) -> list[int]:
    """`justfit serve` on a stand-in engine that does not listen: the ports it was given."""
    ports: list[int] = []
    monkeypatch.setattr(common, "load_engine", lambda *a, **k: SimpleNamespace(runner=LocalRunner(), name="stand-in"))
    monkeypatch.setattr("justfit.server.run", lambda engine, config, ready: ports.append(config.port))
    return ports


def test_p_is_prompt_and_serves_old_p_still_sets_the_port(serve_ports):
    generate = CliRunner().invoke(main, ["generate", "--help"]).output
    serve = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "-p, --prompt" in generate and "--port" in serve and "-p," not in serve
    result = CliRunner().invoke(main, ["serve", "--port", "9001"])
    assert result.exit_code == 0 and serve_ports == [9001] and "deprecated" not in result.stderr
    result = CliRunner().invoke(main, ["serve", "-p", "9002"])
    assert result.exit_code == 0 and serve_ports == [9001, 9002]
    assert result.stderr.count("warning: -p is deprecated; use --port") == 1
    assert CliRunner().invoke(main, ["serve", "-p", "99999"]).exit_code == 2  # still checked as a port


def test_chat_template_is_one_name_across_commands():
    chat = CliRunner().invoke(main, ["chat", "--help"]).output
    serve = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--chat-template FILE" in chat and "--chat-template FILE" in serve
    assert "--template" not in chat.replace("--chat-template", "")  # the old spelling: hidden
