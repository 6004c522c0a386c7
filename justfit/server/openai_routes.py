"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions,
streaming (SSE) and not. Prefill progress goes out as SSE comment lines, which
clients ignore but which keep connections alive through a long prompt."""

from __future__ import annotations

import json
import logging
import time
import uuid

from aiohttp import web

from justfit.model.chat_template import has_chat_template
from justfit.errors import JustFitError, PipelineLost, ServerStopping
from justfit.server.logprobs import chat_entries, chat_entry, chat_logprobs, completion_logprobs
from justfit.server.sessions import STATE_HEADER, state_outcome, stream_note
from justfit.server.schema import BadRequest, get, messages, openai_options, parse_body, token_ids
from justfit.server.tools import ToolCalls

log = logging.getLogger("justfit.server")


def add_routes(app: web.Application, server) -> None:
    """Register the OpenAI routes on `app`."""
    routes = OpenAIRoutes(server)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/v1/chat/completions", routes.chat)
    app.router.add_post("/v1/completions", routes.completions)


NO_CHAT_TEMPLATE = ("this model has no chat template (it is a base model): send the text to /v1/completions "
                    "(OpenAI) or /api/generate (Ollama), which continue it as given, or start `justfit serve` "
                    "with --chat-template FILE")


def chat_tokens(engine, msgs: list[dict], tools: list | None) -> list[int]:
    """`msgs` (and `tools`) through the chat template; BadRequest when there is none or it refuses."""
    if not has_chat_template(engine.tokenizer):  # never a made-up role format the model never saw
        raise BadRequest(NO_CHAT_TEMPLATE, "messages", code="no_chat_template")
    from jinja2.exceptions import TemplateError

    try:
        return engine.apply_chat_template(msgs, tools=tools)
    except TemplateError as e:  # the template's own rules (e.g. alternating roles), in its words
        raise BadRequest(f"the chat template rejected the messages: {e.message or 'no reason given'}",
                         "messages") from None
    except Exception:  # anything else is not the client's to read: details in the log
        log.warning("the chat template failed on a request", exc_info=True)
        raise BadRequest("the chat template could not render these messages", "messages",
                         code="chat_template_failed") from None


def vocab_size(engine) -> int:
    """The model's vocabulary size: its config's, else the tokenizer's."""
    return int(engine.model_config.get("vocab_size") or len(engine.tokenizer.vocab))


def usage(stats) -> dict:
    """OpenAI's usage object for a generation (zeros without stats), with speculative
    decoding's drafted and accepted tokens as extra keys (the openai client keeps them)."""
    prompt = stats.prompt_tokens if stats else 0
    done = stats.generated_tokens if stats else 0
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats else 0},
            "drafted_tokens": stats.drafted_tokens if stats else 0,
            "accepted_tokens": stats.accepted_tokens if stats else 0}


def engine_error(e: Exception) -> BadRequest:
    """An engine failure as the client's answer: 503 when a pipeline rank is gone, 400
    for another JustFitError, else 500."""
    if isinstance(e, PipelineLost):
        return BadRequest(str(e), None, 503, "server_error", "pipeline_degraded")
    if isinstance(e, ServerStopping):
        return BadRequest(str(e), None, 503, "server_error", "server_stopping")
    if isinstance(e, JustFitError):
        return BadRequest(str(e), None, 400, "context_length_exceeded", "context_length_exceeded")
    return BadRequest("internal error while generating", None, 500, "server_error")


async def collect(job, tools: ToolCalls) -> tuple[str, list[dict], object, list]:
    """A whole reply: its visible text, the tool calls parsed from it, the stats (None if
    cancelled) and every chunk; an engine error raised as the client's answer."""
    parts, chunks, stats, error = [], [], None, None
    async for event, p in job.stream():
        if event == "chunk":
            parts.append(tools.feed(p.text))
            chunks.append(p)
        elif event == "error":
            error = p
        elif event == "done":
            stats = p
    if error is not None:
        raise engine_error(error)
    parts.append(tools.flush())
    return "".join(parts), tools.calls(), stats, chunks


class OpenAIRoutes:
    """Handlers of the OpenAI-compatible API over one server."""

    def __init__(self, server):
        self.server, self.engine = server, server.engine

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one model served."""
        return web.json_response({"object": "list", "data": [
            {"id": self.server.model_id, "object": "model", "created": self.server.created, "owned_by": "justfit",
             "context_length": self.engine.context_limit,
             "has_chat_template": has_chat_template(self.engine.tokenizer)}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: a chat reply, streamed (SSE) or whole."""
        body = parse_body(await request.read())
        self.server.check_model(body.get("model"))
        opts = openai_options(body, self.server.config.default_max_tokens, defaults=self.engine.default_sampling)
        msgs = messages(body)
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, opts.tools)
        return await self._generate(request, lambda: chat_tokens(self.engine, msgs, opts.tools), opts, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: a continuation of a text or token prompt, streamed or whole."""
        body = parse_body(await request.read())
        self.server.check_model(body.get("model"))
        opts = openai_options(body, self.server.config.default_max_tokens, False, self.engine.default_sampling)
        if get(body, "echo", bool, False) or body.get("best_of", 1) not in (1, None):
            raise BadRequest("echo and best_of are not supported", "echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            await self.server.tokenizing.refuse_oversized(self.engine, prompt, param="prompt")
            return await self._generate(request, lambda: self.engine.encode(prompt), opts, "text")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return await self._generate(request, lambda: token_ids(prompt, vocab_size(self.engine), "prompt"),
                                        opts, "text")
        raise BadRequest("'prompt' must be a string, an array of token ids, or a batch of one", "prompt")

    # -- the common part -------------------------------------------------------------
    async def _generate(self, request, tokenize, opts, kind: str) -> web.StreamResponse:
        """`tokenize()` and the plan on the tokenizer thread, then the request queued."""
        tokens = await self.server.prepare(tokenize, opts)
        job, ahead = self.server.submit(tokens, opts, "openai", request)
        tools = ToolCalls(self.engine.tokenizer, opts.tools if kind == "chat" else None)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            if opts.stream:
                return await self._stream(request, job, ahead, opts, tools, rid, kind)
            return await self._collect(job, tools, rid, kind)
        finally:
            job.cancel.set()  # a no-op once finished; stops the work if the client left

    def _head(self, rid: str, kind: str) -> dict:
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.server.model_id}

    async def _collect(self, job, tools: ToolCalls, rid: str, kind: str) -> web.Response:
        text, calls, stats, chunks = await collect(job, tools)
        entries = await self.server.tokenizing.run(chat_entries, self.engine.tokenizer, chunks)
        reason = "tool_calls" if calls else (stats.finish_reason if stats else "stop")
        logprobs = None if job.sampling.logprobs is None else (
            chat_logprobs(entries) if kind == "chat" else completion_logprobs(entries))
        if kind == "chat":
            message = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        stored = await state_outcome(stats, self.server.config.write_wait_s)  # durable before the answer
        resp = web.json_response({**self._head(rid, kind), "choices": [choice], "usage": usage(stats)})
        if stored is not None:
            resp.headers[STATE_HEADER] = stored.header()
        return resp

    async def _stream(self, request, job, ahead, opts, tools, rid, kind) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        head = {**self._head(rid, kind), "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}

        def data(choice: dict | None, **extra) -> bytes:
            body = {**head, "choices": [choice] if choice else [], **extra}
            return f"data: {json.dumps(body)}\n\n".encode()

        entries: list[dict] = []  # logprobs of tokens whose text is not sent yet
        sent_chars = 0

        def piece(text: str | None = None, reason: str | None = None, **delta) -> bytes:
            nonlocal sent_chars
            logprobs = None
            if entries and (text or reason):
                logprobs = chat_logprobs(entries[:]) if kind == "chat" else completion_logprobs(entries, sent_chars)
                entries.clear()
            sent_chars += len(text or "")
            if kind == "chat":
                if text:
                    delta["content"] = text
                return data({"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs})
            return data({"index": 0, "text": text or "", "finish_reason": reason, "logprobs": logprobs})

        try:
            if ahead:
                await resp.write(f": queued {json.dumps({'ahead': ahead})}\n\n".encode())
            if kind == "chat":
                await resp.write(piece(role="assistant", content=""))
            stats, cached, total = None, None, len(job.tokens)
            async for event, p in job.stream(tick=self.server.config.keepalive_s):
                if event == "tick":  # a long prefill chunk (or the queue): say so, keep proxies awake
                    if job.started is not None and not job.generated:
                        info = {"total": total, "cached": cached or 0, "processed": job.processed,
                                "elapsed": round(time.monotonic() - job.started, 3)}
                        await resp.write(f": prompt_progress {json.dumps(info)}\n\n".encode())
                    else:
                        await resp.write(f": {'queued' if job.started is None else 'keepalive'}\n\n".encode())
                elif event == "progress":
                    done, total, elapsed = p
                    cached = done if cached is None else cached
                    info = {"total": total, "cached": cached, "processed": done, "elapsed": round(elapsed, 3)}
                    await resp.write(f": prompt_progress {json.dumps(info)}\n\n".encode())
                elif event == "chunk":
                    if p.logprob is not None:  # the token's text: a tokenizer call, so on its thread
                        entries.append(await self.server.tokenizing.run(chat_entry, self.engine.tokenizer, p))
                    text = tools.feed(p.text)
                    if text:
                        await resp.write(piece(text))
                elif event == "error":
                    await resp.write(f"data: {json.dumps(engine_error(p).body())}\n\n".encode())
                elif event == "done":
                    stats = p
            # The turn's session state is durable before the reply's end is sent.
            await resp.write(stream_note(await state_outcome(stats, self.server.config.write_wait_s)))
            tail = tools.flush()
            if tail:
                await resp.write(piece(tail))
            calls = tools.calls(streaming=True)
            if calls:
                await resp.write(piece(tool_calls=calls))
            if stats is not None:
                await resp.write(piece(reason="tool_calls" if calls else stats.finish_reason))
                if opts.include_usage:
                    await resp.write(data(None, usage=usage(stats)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client left: cancel (in _generate), nobody to tell
            job.cancel.set()
        return resp
