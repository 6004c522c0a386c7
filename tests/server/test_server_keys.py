"""API keys on a live server: several accepted, each its own scope (what stored state
is filed under, never the key itself), compared in constant time with every key;
key files read with comments, and refused with a clear error when unreadable or empty."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession, web

from justfit import Engine
from justfit.config import EngineConfig
from justfit.server import Server, ServerConfig, connections, keys


@pytest.fixture(scope="module")
def engine(tiny_gemma3_dir):
    return Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16))


async def _scopes_seen(engine, config: ServerConfig, attempts: list[dict]) -> list[tuple[int, str | None]]:
    """(status, request["scope"]) of a request per header set in `attempts`, on a server
    with `config` and one extra route that shows the scope its request got."""
    server = Server(engine, config)
    app = server.app()
    app.router.add_get("/test/scope", _show_scope)
    runner = web.AppRunner(app)
    await runner.setup()
    _, port = await connections.listener(config)(runner, "127.0.0.1", 0)
    try:
        out = []
        async with ClientSession() as session:
            for headers in attempts:
                async with session.get(f"http://127.0.0.1:{port}/test/scope", headers=headers) as r:
                    out.append((r.status, (await r.json()).get("scope") if r.status == 200 else None))
        return out
    finally:
        await runner.cleanup()
        server.close()


async def _show_scope(request: web.Request) -> web.Response:
    return web.json_response({"scope": request[keys.SCOPE]})


def test_several_keys_each_with_its_own_scope(engine):
    config = ServerConfig(port=0, api_key="gamma-key", api_keys=("alpha-key", "beta-key"))
    seen = asyncio.run(_scopes_seen(engine, config, [
        {"Authorization": "Bearer alpha-key"}, {"x-api-key": "beta-key"}, {"Authorization": "bearer gamma-key"},
        {"Authorization": "Bearer alpha-key"}, {"Authorization": "Bearer wrong"}, {"x-api-key": "alpha-keyX"}, {}]))
    assert [status for status, _ in seen] == [200, 200, 200, 200, 401, 401, 401]
    scopes = [scope for _, scope in seen[:4]]
    assert scopes == [keys.scope("alpha-key"), keys.scope("beta-key"), keys.scope("gamma-key"), scopes[0]]
    assert len(set(scopes)) == 3 and all(len(s) == 16 and "key" not in s for s in scopes)
    assert asyncio.run(_scopes_seen(engine, ServerConfig(port=0), [{}])) == [(200, "")]  # no keys: shared


def test_a_key_is_compared_with_every_key(monkeypatch):
    calls = []
    compare = keys.hmac.compare_digest
    monkeypatch.setattr(keys.hmac, "compare_digest", lambda a, b: calls.append(1) or compare(a, b))
    accepted = ("alpha", "beta", "gamma")
    for candidates, scope in ((["alpha"], keys.scope("alpha")), (["gamma"], keys.scope("gamma")),
                              (["nope"], None), (["nope", "beta"], keys.scope("beta"))):
        calls.clear()
        assert keys.match(candidates, accepted) == scope
        assert len(calls) == 3 * len(candidates)  # the same work whichever matched, or none


def test_key_files(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# team keys\nalpha\n\n  beta  \n# old: gamma\nalpha\n")
    assert keys.read_file(good) == ("alpha", "beta")
    (tmp_path / "empty").write_text("# nothing yet\n\n")
    (tmp_path / "spaced").write_text("two words\n")
    for name, says in (("empty", "holds no key"), ("missing", "cannot read"), ("spaced", "line 1")):
        with pytest.raises(ValueError, match=says):
            keys.read_file(tmp_path / name)


def test_serve_refuses_a_bad_key_file_before_loading(tmp_path):
    from click.testing import CliRunner

    from cli.main import main

    (tmp_path / "empty").write_text("# none\n")
    for path, says in ((tmp_path / "empty", "holds no key"), (tmp_path / "missing", "cannot read")):
        result = CliRunner().invoke(main, ["serve", "--api-keys", str(path)])
        assert result.exit_code == 2 and says in result.output and "loading" not in result.output, result.output
