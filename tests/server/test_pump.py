"""The pump (justfit.server.pump) with a fake job: typed events in, each API family's
bytes out; a failure's stable code reaches every family's error shape."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from justfit.engine.events import End, Failure, Progress, Tick, Token
from justfit.engine.events import JobStatus
from justfit.engine.stats import Chunk, GenerationStats
from justfit.errors import BudgetExceeded, PipelineLost, ServerStopping
from justfit.server import pump
from justfit.server.anthropic_format import AnthropicFormat
from justfit.server.app import _error_response
from justfit.server.ollama_format import OllamaFormat
from justfit.server.openai_format import OpenAIFormat
from justfit.server.schema import BadRequest


class FakeJob:
    """Sends its events, in order, as a job's stream would (Ticks included as given)."""

    def __init__(self, events: list):
        self.events, self.cancel = events, threading.Event()

    async def stream(self, tick: float | None = None):
        for event in self.events:
            yield event


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


async def _run(fn, *args):
    return fn(*args)


SERVER = SimpleNamespace(engine=SimpleNamespace(tokenizer=FakeTokenizer()), tokenizing=SimpleNamespace(run=_run),
                         config=SimpleNamespace(keepalive_s=1.0, write_wait_s=1.0))
STATS = GenerationStats(prompt_tokens=5, cached_tokens=2, generated_tokens=2, prefill_s=0.5, decode_s=0.25,
                        finish_reason="stop")
QUEUED, STARTED = JobStatus(started=None, last_event=0.0), JobStatus(started=10.0, processed=3, last_event=10.0)
EVENTS = [Tick(QUEUED, 9.0), Progress(2, 5, 0.1234), Tick(STARTED, 10.5),
          Token(Chunk("Hel", 1, logprob=-0.5, top_logprobs=[(1, -0.5)])),
          Token(Chunk("lo", 2, finish_reason="stop", stats=STATS, logprob=-0.25, top_logprobs=[])), End(STATS)]


def streamed(fmt, events: list, ahead: int = 0) -> tuple[str, FakeJob]:
    """What a client reads of `fmt`'s stream of `events`, ids and clocks made fixed."""
    job = FakeJob(events)

    async def main() -> str:
        async def handler(request):
            return await pump.reply(SERVER, request, job, fmt, None, True, ahead)

        app = web.Application()
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/")
            return await resp.text()

    return fixed(asyncio.run(main())), job


def whole(fmt, events: list) -> dict:
    job = FakeJob(events)
    resp = asyncio.run(pump.reply(SERVER, None, job, fmt, None, False))
    assert job.cancel.is_set()
    return json.loads(fixed(resp.text))


def fixed(text: str) -> str:
    text = re.sub(r'"(chatcmpl-|cmpl-|msg_)[0-9a-f]{24}"', r'"\1ID"', text)
    text = re.sub(r'"created": \d+', '"created": 0', text)
    text = re.sub(r'"created_at": "[^"]+"', '"created_at": "T"', text)
    return re.sub(r'"total_duration": \d+', '"total_duration": 0', text)


def sse(*data: str) -> str:
    return "".join(f"{d}\n\n" for d in data)


CHAT_HEAD = '"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "m"'
USAGE = ('{"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": '
         '{"cached_tokens": 2}, "drafted_tokens": 0, "accepted_tokens": 0, "forced_tokens": 0}')
ENTRY_1 = ('{"token": "<1>", "logprob": -0.5, "bytes": [60, 49, 62], "top_logprobs": '
           '[{"token": "<1>", "logprob": -0.5, "bytes": [60, 49, 62]}]}')
ENTRY_2 = '{"token": "<2>", "logprob": -0.25, "bytes": [60, 50, 62], "top_logprobs": []}'
PROGRESS_COMMENTS = (': prompt_progress {"total": 5, "cached": 2, "processed": 2, "elapsed": 0.123}',
                     ': prompt_progress {"total": 5, "cached": 2, "processed": 3, "elapsed": 0.5}')


def test_openai_chat_streams_sse_with_comments_logprobs_and_usage():
    text, job = streamed(OpenAIFormat("m", True, 5, True, True), EVENTS, ahead=1)
    assert text == sse(
        ': queued {"ahead": 1}',
        f'data: {{{CHAT_HEAD}, "choices": [{{"index": 0, "delta": {{"role": "assistant", "content": "", "refusal": null}}, '
        '"finish_reason": null, "logprobs": null}]}',
        ": queued", *PROGRESS_COMMENTS,
        f'data: {{{CHAT_HEAD}, "choices": [{{"index": 0, "delta": {{"content": "Hel"}}, "finish_reason": null, '
        f'"logprobs": {{"content": [{ENTRY_1}], "refusal": null}}}}]}}',
        f'data: {{{CHAT_HEAD}, "choices": [{{"index": 0, "delta": {{"content": "lo"}}, "finish_reason": null, '
        f'"logprobs": {{"content": [{ENTRY_2}], "refusal": null}}}}]}}',
        f'data: {{{CHAT_HEAD}, "choices": [{{"index": 0, "delta": {{}}, "finish_reason": "stop", "logprobs": null}}]}}',
        f'data: {{{CHAT_HEAD}, "choices": [], "usage": {USAGE}}}',
        "data: [DONE]")
    assert job.cancel.is_set()  # the pump cancels the job whenever the reply ends


def test_openai_completion_streams_text_pieces_with_offsets():
    text, _ = streamed(OpenAIFormat("m", False, 5, True, False), EVENTS)
    head = '"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "m"'
    assert text == sse(
        ": queued", *PROGRESS_COMMENTS,
        f'data: {{{head}, "choices": [{{"index": 0, "text": "Hel", "finish_reason": null, "logprobs": '
        '{"tokens": ["<1>"], "token_logprobs": [-0.5], "top_logprobs": [{"<1>": -0.5}], "text_offset": [0]}}]}',
        f'data: {{{head}, "choices": [{{"index": 0, "text": "lo", "finish_reason": null, "logprobs": '
        '{"tokens": ["<2>"], "token_logprobs": [-0.25], "top_logprobs": [{}], "text_offset": [3]}}]}',
        f'data: {{{head}, "choices": [{{"index": 0, "text": "", "finish_reason": "stop", "logprobs": null}}]}}',
        "data: [DONE]")


def test_openai_whole_replies():
    chat = whole(OpenAIFormat("m", True, 5, True, True), EVENTS)
    assert chat == {"id": "chatcmpl-ID", "object": "chat.completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello", "refusal": None},
                                 "finish_reason": "stop",
                                 "logprobs": {"content": [json.loads(ENTRY_1), json.loads(ENTRY_2)],
                                              "refusal": None}}],
                    "usage": json.loads(USAGE)}
    text = whole(OpenAIFormat("m", False, 5, False, False), EVENTS)
    assert text["object"] == "text_completion" and text["choices"] == [
        {"index": 0, "text": "Hello", "finish_reason": "stop", "logprobs": None}]


OLLAMA_TIMINGS = ('"done_reason": "stop", "total_duration": 0, "load_duration": 0, "prompt_eval_count": 3, '
                  '"prompt_eval_duration": 500000000, "eval_count": 2, "eval_duration": 250000000, '
                  '"drafted_tokens": 0, "accepted_tokens": 0, "forced_tokens": 0')


def test_ollama_streams_ndjson_without_keepalives():
    text, _ = streamed(OllamaFormat("m", True, [7, 8]), EVENTS, ahead=1)
    line = '{"model": "m", "created_at": "T", "message": {"role": "assistant", "content": "%s"}, "done": %s'
    assert text.splitlines() == [
        line % ("", "false") + ', "prompt_progress": {"total": 5, "processed": 2, "elapsed": 0.123}}',
        line % ("Hel", "false") + "}", line % ("lo", "false") + "}",
        line % ("", "true") + f", {OLLAMA_TIMINGS}}}"]
    generated, _ = streamed(OllamaFormat("m", False, [7, 8]), EVENTS)
    assert json.loads(generated.splitlines()[-1])["context"] == [7, 8, 1, 2]  # the prompt's and the reply's


def test_ollama_whole_replies():
    assert whole(OllamaFormat("m", False, [7, 8]), EVENTS) == json.loads(
        f'{{"model": "m", "created_at": "T", "response": "Hello", "done": true, {OLLAMA_TIMINGS}, '
        '"context": [7, 8, 1, 2]}')
    assert whole(OllamaFormat("m", True, [7, 8]), EVENTS)["message"] == {"role": "assistant", "content": "Hello"}


def named(kind: str, data: str) -> str:
    return f'event: {kind}\ndata: {{"type": "{kind}"{", " + data if data else ""}}}'


def test_anthropic_streams_named_events():
    text, _ = streamed(AnthropicFormat("m", 5), EVENTS)
    assert text == sse(
        named("message_start", '"message": {"id": "msg_ID", "type": "message", "role": "assistant", "model": "m", '
              '"content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 5, '
              '"output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}'),
        named("ping", ""), named("ping", ""),
        named("content_block_start", '"index": 0, "content_block": {"type": "text", "text": ""}'),
        named("ping", ""),
        named("content_block_delta", '"index": 0, "delta": {"type": "text_delta", "text": "Hel"}'),
        named("content_block_delta", '"index": 0, "delta": {"type": "text_delta", "text": "lo"}'),
        named("content_block_stop", '"index": 0'),
        named("message_delta", '"delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": '
              '{"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 2, '
              '"cache_creation_input_tokens": 0, "drafted_tokens": 0, "accepted_tokens": 0, "forced_tokens": 0}'),
        named("message_stop", ""))


def test_anthropic_first_progress_reports_the_cached_positions():
    text, _ = streamed(AnthropicFormat("m", 5), EVENTS[1:])
    start = json.loads(text.split("\n")[1].removeprefix("data: "))
    assert start["message"]["usage"]["cache_read_input_tokens"] == 2 and start["message"]["usage"]["input_tokens"] == 3


def test_anthropic_whole_reply():
    assert whole(AnthropicFormat("m", 5), EVENTS) == {
        "id": "msg_ID", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 2, "cache_read_input_tokens": 2,
                  "cache_creation_input_tokens": 0, "drafted_tokens": 0, "accepted_tokens": 0, "forced_tokens": 0}}


# -- failures -----------------------------------------------------------------------------
FAILURES = {"pipeline_degraded": (PipelineLost("rank 1 is gone"), 503),
            "server_stopping": (ServerStopping(), 503),
            "context_length_exceeded": (BudgetExceeded(2**30, 2**20, 10, 20), 400),
            "internal_error": (RuntimeError("a secret path /x"), 500)}
FORMATS = {"openai": lambda: OpenAIFormat("m", True, 5, False, False), "ollama": lambda: OllamaFormat("m", True, [7]),
           "anthropic": lambda: AnthropicFormat("m", 5)}


@pytest.mark.parametrize("code", FAILURES)
def test_a_failures_code_reaches_each_familys_whole_answer(code):
    error, status = FAILURES[code]
    assert Failure.of(error).code == code
    for family, fmt in FORMATS.items():
        job = FakeJob([Token(Chunk("Hel", 1)), Failure.of(error), End(None)])
        with pytest.raises(BadRequest) as raised:
            asyncio.run(pump.reply(SERVER, None, job, fmt(), None, False))
        answer = raised.value
        assert answer.status == status and job.cancel.is_set()
        body = json.loads(_error_response(answer, family == "ollama", family == "anthropic").text)
        message = "internal error while generating" if code == "internal_error" else str(error)
        if family == "openai":
            assert body["error"]["code"] == (None if code == "internal_error" else code)
            assert body["error"]["message"] == message
        elif family == "ollama":
            assert body == {"error": message}
        else:
            kinds = {503: "overloaded_error", 400: "invalid_request_error", 500: "api_error"}
            assert body == {"type": "error", "error": {"type": kinds[status], "message": message}}


@pytest.mark.parametrize("code", FAILURES)
def test_a_failures_code_reaches_each_familys_stream(code):
    error, status = FAILURES[code]
    events = [Progress(0, 5, 0.0), Token(Chunk("Hel", 1)), Failure.of(error), End(None)]
    message = "internal error while generating" if code == "internal_error" else str(error)
    openai, _ = streamed(FORMATS["openai"](), events)
    sent = json.loads(openai.split("\n\n")[3].removeprefix("data: "))
    assert sent["error"]["code"] == (None if code == "internal_error" else code)
    assert sent["error"]["message"] == message and openai.endswith("data: [DONE]\n\n")  # the stream goes on
    ollama, _ = streamed(FORMATS["ollama"](), events)
    assert json.loads(ollama.splitlines()[-1]) == {"error": message}  # and ends there
    anthropic, _ = streamed(FORMATS["anthropic"](), events)
    kinds = {503: "overloaded_error", 400: "invalid_request_error", 500: "api_error"}
    assert anthropic.endswith(sse(named("error", json.dumps({"error": {"type": kinds[status], "message": message}})
                                        [1:-1])))
