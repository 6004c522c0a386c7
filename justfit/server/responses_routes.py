"""OpenAI's Responses API: POST /v1/responses (streamed as the Responses events, or
whole), GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request is checked and translated (justfit.server.responses_request), templated,
tokenized, planned and queued as a chat completion is, and its reply pumped
(justfit.server.pump) in the Responses shapes (justfit.server.responses_format).
Unless `store` is false the finished response is kept (justfit.server.responses_store,
scoped by the client's key) with the name of the session holding its state: a chain
of responses continues one named session, so a turn naming `previous_response_id`
prefills only what is new (`usage.input_tokens_details.cached_tokens`), its prompt
built on the previous turn's exact token ids where its text extends them; a response
continuing one that is no longer its session's newest starts a session of its own,
from the longest stored prefix. Errors come back in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from justfit.server import pump
from justfit.model.chat_template import has_chat_template
from justfit.server.openai_routes import chat_tokens
from justfit.server.responses_format import ResponsesFormat
from justfit.server.responses_request import chat_messages, new_id, responses_request
from justfit.server.responses_store import StoredResponse
from justfit.server.schema import BadRequest, get, parse_body
from justfit.server.sessions import StateOutcome, scope_of

log = logging.getLogger("justfit.server")

SESSION_PREFIX = "responses:"  # a chain's session: this and its first response's id


def add_routes(app: web.Application, server) -> None:
    """Register the Responses API's routes on `app`."""
    routes = ResponsesRoutes(server)
    app.router.add_post("/v1/responses", routes.create)
    app.router.add_get("/v1/responses/{id}", routes.retrieve)
    app.router.add_delete("/v1/responses/{id}", routes.delete)
    app.router.add_get("/v1/responses/{id}/input_items", routes.input_items)


def not_found(rid: str, param: str, code: str) -> BadRequest:
    """The 404 for a response that is not stored for this key (never stored, deleted, evicted, expired)."""
    return BadRequest(f"Response with id '{rid[:200]}' not found.", param, 404, "invalid_request_error", code)


class ResponsesRoutes:
    """Handlers of the Responses API over one server and its response store."""

    def __init__(self, server):
        self.server, self.engine, self.store = server, server.engine, server.responses

    async def _run(self, fn, *args):
        """`fn(*args)` on the store's thread (its reads and writes stay in order)."""
        return await asyncio.wrap_future(self.store.run(fn, *args))

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: a reply, streamed as the Responses events or whole."""
        body = parse_body(await request.read())
        self.server.check_model(body.get("model"))
        req = responses_request(body, self.server.config.default_max_tokens, self.engine.default_sampling)
        scope = scope_of(request)
        await self._run(self.store.load_scope, scope)
        earlier, session, prev = [], None, None
        if req.previous_response_id:
            prev = await self._run(self.store.get, scope, req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id", "previous_response_not_found")
            earlier = prev.conversation()
            session = prev.session if self.store.is_head(scope, prev) else None  # else: a fork
        rid = new_id("resp")
        req.opts.session = self._session(session or SESSION_PREFIX + rid) if req.store else None
        items = [*earlier, *req.items]
        msgs = chat_messages(items, req.instructions)
        if not any(m["role"] != "system" for m in msgs):
            raise BadRequest("'input' must hold at least one message or function call output", "input")
        await self.server.tokenizing.refuse_oversized(self.engine, msgs, req.opts.tools, param="input")
        prompt: dict = {}  # the rendered text, for the context this response stores
        tokens = await self.server.prepare(
            lambda: prompt_tokens(self.engine, msgs, req.opts.tools, prev.context if prev else None, prompt), req.opts)
        job, ahead = self.server.submit(tokens, req.opts, "responses", request)
        done = self._keeper(scope, rid, items, req.opts.session, tokens, prompt.get("text")) if req.store else None
        fmt = ResponsesFormat({"id": rid, "model": self.server.model_id, **req.echo}, len(tokens), done)
        return await pump.reply(self.server, request, job, fmt, req.opts.tool_mode, req.opts.stream, ahead)

    def _session(self, name: str) -> str | None:
        """`name`, where the runner keeps named sessions (a layer pipeline does not: the
        response is stored, its state is not)."""
        try:
            self.engine.runner.refuse_session(name)
        except ValueError:
            return None
        return name

    def _keeper(self, scope: str, rid: str, items: list[dict], session: str | None, prompt_ids: list[int],
                prompt_text: str | None):
        """What stores a finished response (called before its last event goes out)."""
        eos = set(getattr(self.engine.tokenizer, "eos_token_ids", ()) or ())

        def keep(response: dict, stored: StateOutcome | None, token_ids: list[int]) -> None:
            name = stored.fork if stored is not None and stored.fork else session
            context = reply_context(response, prompt_text, prompt_ids, token_ids, eos)
            orphans = self.store.put(scope, StoredResponse(rid, self.store.clock(), name, response, items,
                                                           context=context))
            self._drop_sessions(scope, orphans)

        return keep

    def _drop_sessions(self, scope: str, names: list[str]) -> None:
        """Delete sessions no stored response names any more (off the loop; one in use stays)."""
        states = getattr(self.engine, "states", None)
        for name in names:
            if states is not None and not self.server.scheduler.uses_session(name, scope):
                self.store.run(_drop, states, name, scope)

    async def _stored(self, request: web.Request) -> StoredResponse:
        rid = request.match_info["id"]
        record = await self._run(self.store.get, scope_of(request), rid)
        if record is None:
            raise not_found(rid, "response_id", "response_not_found")
        return record

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: the stored response object."""
        if request.query.get("stream") in ("true", "1"):
            raise BadRequest("streaming a stored response again is not supported", "stream")
        return web.json_response((await self._stored(request)).response)

    async def delete(self, request: web.Request) -> web.Response:
        """DELETE /v1/responses/{id}: the stored response (and its session, once no stored
        response names it)."""
        rid, scope = request.match_info["id"], scope_of(request)
        found, orphans = await self._run(self.store.delete, scope, rid)
        if not found:
            raise not_found(rid, "response_id", "response_not_found")
        self._drop_sessions(scope, orphans)
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}/input_items: the items the response was given (earlier
        turns' included), newest first unless order=asc; `limit` (1-100) and `after`
        (an item id) page through them."""
        query = dict(request.query)
        if "limit" in query:
            try:
                query["limit"] = int(query["limit"])
            except ValueError:
                raise BadRequest("'limit' must be an integer", "limit") from None
        limit = get(query, "limit", int, 20, lo=1, hi=100)
        order = get(query, "order", str, "desc")
        if order not in ("asc", "desc"):
            raise BadRequest("'order' must be asc or desc", "order")
        items = (await self._stored(request)).items
        items = items if order == "asc" else items[::-1]
        after = query.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if at is None:
                raise BadRequest(f"no input item {after[:200]!r} in this response", "after")
            items = items[at + 1:]
        page = items[:limit]
        return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def prompt_tokens(engine, msgs: list[dict], tools: list | None, context: dict | None, rendered: dict) -> list[int]:
    """The prompt's token ids (`rendered["text"]` set to its text). Where the rendered
    text extends the previous response's context (its prompt's text and its reply), the
    ids are that context's own (its prompt's, and the reply's exactly as generated) and
    only the rest is tokenized: the turn extends the stored state to the token, where a
    fresh tokenization of the reply might part from it. Otherwise as a chat completion."""
    tokenizer, text = engine.tokenizer, None
    if has_chat_template(tokenizer) and getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - a refusal: chat_tokens answers it in the client's terms
            text = None
    if isinstance(text, str):
        rendered["text"] = text
        if context is not None and len(text) > len(context["text"]) and text.startswith(context["text"]):
            try:
                return [*context["ids"], *tokenizer.encode(text[len(context["text"]):], add_special_tokens=False)]
            except TypeError:  # a tokenizer without add_special_tokens: tokenized whole below
                pass
    return chat_tokens(engine, msgs, tools)


def reply_context(response: dict, prompt_text: str | None, prompt_ids: list[int], token_ids: list[int],
                  eos: set[int]) -> dict | None:
    """What a response continuing this one may start from: the prompt's text and the
    reply's, with their token ids (the reply's end-of-turn token left to the template's
    text); None where the reply is not plain text (a function call is rendered anew)."""
    output = response.get("output") or []
    if prompt_text is None or len(output) != 1 or output[0].get("type") != "message":
        return None
    ids = list(token_ids)
    while ids and ids[-1] in eos:
        ids.pop()
    text = "".join(p.get("text", "") for p in output[0].get("content", []))
    return {"text": prompt_text + text, "ids": [*prompt_ids, *ids]}


def _drop(states, name: str, scope: str) -> None:
    try:
        states.drop(name, scope)
    except Exception:  # noqa: BLE001 - a session left behind is the quota's to evict, never a request's failure
        log.warning("could not delete session %r of a deleted response", name, exc_info=True)
