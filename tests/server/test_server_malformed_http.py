"""Malformed HTTP gets a plain 400 (justfit/server/malformed.py): a fixed JSON error that
quotes none of the bytes sent, where aiohttp's own answer quotes the line it choked on.
Each request is sent on a raw socket and carries a marker the answer must not contain."""

from __future__ import annotations

import asyncio
import json

import pytest

from justfit import Engine
from justfit.config import EngineConfig
from tests.helpers.server_harness import LiveServer, request

MARKER = b"Zq7MarkerXk"
CHUNKED_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
MALFORMED = {
    "request line": [b"GET /" + MARKER + b" HTTP/1.1 extra\r\nHost: t\r\n\r\n"],
    "method": [MARKER + b"\x01 / HTTP/1.1\r\nHost: t\r\n\r\n"],
    "version": [b"GET / HTTP/9." + MARKER + b"\r\nHost: t\r\n\r\n"],
    "header": [b"GET /health HTTP/1.1\r\nHost: t\r\nBad Header " + MARKER + b": x\r\n\r\n"],
    "chunked": [CHUNKED_HEAD + b"zz" + MARKER + b"\r\n"],
    "oversized header": [b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + MARKER * 1000 + b"\r\n\r\n"],
    "not UTF-8": [b"\xff\xfe" + MARKER + b"\x80\x81\r\n\r\n"],
    "not HTTP": [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + MARKER + b"\r\n"],  # a TLS hello
}


@pytest.fixture(scope="module")
def live(tiny_gemma3_dir):
    s = LiveServer(Engine(str(tiny_gemma3_dir), config=EngineConfig(prefill_chunk=16)), body_timeout_s=1.0)
    yield s
    s.close()


async def _answer(port: int, parts: list[bytes]) -> bytes:
    """Send `parts` (a moment apart), then everything received until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(0.3)
        writer.write(part)
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            got += chunk
    except ConnectionError:
        pass
    writer.close()
    return got


def _no_marker(got: bytes) -> None:
    """Neither the marker (in any case) nor its hex form anywhere in the answer."""
    assert MARKER.lower() not in got.lower() and MARKER.hex().encode() not in got.lower(), got[:300]


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_http_gets_a_plain_400_without_the_bytes_sent(live, case):
    got = asyncio.run(_answer(live.port, MALFORMED[case]))
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ")[1] == b"400", got[:300]
    assert json.loads(body) == {"error": {"message": "malformed HTTP request", "type": "invalid_request_error",
                                          "param": None, "code": "malformed_http"}}
    _no_marker(got)
    assert request(live, "GET", "/health")[0] == 200  # and the server goes on


def test_a_chunked_body_that_goes_bad_later_times_out_without_the_bytes(live):
    """Once a request has reached its handler, aiohttp's parser drops a chunk error for
    it (the handler would wait for the rest): the body timeout answers 408 instead."""
    got = asyncio.run(_answer(live.port, [CHUNKED_HEAD + b"5\r\n{\"mes\r\n", b"zz" + MARKER + b"\r\n"]))
    assert got.startswith(b"HTTP/1.1 408"), got[:300]
    _no_marker(got)
