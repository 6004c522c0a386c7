"""Structured output on every API: each API's request fields for a reply's shape mapped
to the one OutputConstraint (justfit.config) the engine makes the reply follow, and
tool_choice mapped to a ToolMode (justfit.server.tools) that says how the reply's tool
calls come about.

- OpenAI (/v1/chat/completions, /v1/completions): `response_format` (text, json_object,
  json_schema), `tools` with `tool_choice` (none, auto, required, a named function,
  allowed_tools) and `parallel_tool_calls`; the extensions llama-server and vLLM clients
  send: `grammar` (GBNF), `json_schema`, `regex`, `structured_outputs` (json, regex,
  grammar, choice, json_object) and vLLM's older `guided_*` fields.
- Ollama (/api/chat, /api/generate): `format`, "json" or a JSON Schema.
- Anthropic (/v1/messages): `output_config.format` (and the older `output_format`) and
  `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`).

A request gets at most one constraint: two fields that each ask for one are a 400.
A forced tool call (OpenAI's required or named function, Anthropic's any or tool) is
a JSON constraint of the call(s) themselves, `{"name": NAME, "arguments": ARGS}` (an
array of them where parallel calls are allowed), which the reply's format writes as
the API's tool calls. Every constraint is compiled once before any work (`check`), a
grammar that cannot compile a 400 with code `invalid_grammar`."""

from __future__ import annotations

import json
from dataclasses import replace

from justfit.config import OutputConstraint
from justfit.errors import GrammarError
from justfit.server.schema import BadRequest, Options, get
from justfit.server.tools import ToolMode

NO_TOOLS = ToolMode()
REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")  # characters a regex needs escaped (Rust regex syntax)


# -- OpenAI ------------------------------------------------------------------------------
def response_format_constraint(fmt: dict | None, path: str = "response_format") -> OutputConstraint | None:
    """OpenAI's `response_format`: text is free text (None), json_object any JSON
    object, json_schema the JSON Schema in `json_schema.schema` (`strict` accepted
    either way: the schema is always followed)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadRequest(f"'{path}' must be an object", path)
    kind = get(fmt, "type", str, where=f"{path}.")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind != "json_schema":
        raise BadRequest(f"'{path}.type' must be text, json_object or json_schema, not {kind!r}", f"{path}.type")
    spec = get(fmt, "json_schema", dict, where=f"{path}.")
    get(spec, "name", str, "", where=f"{path}.json_schema.")
    get(spec, "strict", bool, False, where=f"{path}.json_schema.")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: any JSON object then
        return OutputConstraint("json_object")
    return schema_constraint(schema, f"{path}.json_schema.schema")


def schema_constraint(schema, path: str) -> OutputConstraint:
    """A JSON Schema (an object, or its JSON text) as a json_schema constraint."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise BadRequest(f"'{path}' is not valid JSON", path) from None
    if isinstance(schema, bool):  # `true` allows anything; `false` nothing, which check refuses
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise BadRequest(f"'{path}' must be a JSON Schema object", path)
    try:
        return OutputConstraint("json_schema", json.dumps(schema))
    except RecursionError:
        raise BadRequest(f"'{path}' is nested too deeply", path) from None


def tool_choice_constraint(tools, tool_choice, parallel_tool_calls: bool | None = None, path: str = "tool_choice"
                           ) -> tuple[OutputConstraint | None, ToolMode]:
    """OpenAI's `tool_choice` over `tools`: none drops the tools (no calls); auto (the
    default with tools) leaves the text free and parses calls from the model's markers;
    required (a call of any tool) and a named function constrain the reply to the JSON
    of the call(s), one object or, `parallel_tool_calls` (default true), an array of
    1..N; allowed_tools narrows the tools to those it names, then works as its mode
    (auto or required). A tool's arguments follow its `parameters` whether it says
    `strict` or not."""
    defs = _function_tools(tools)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        kind = get(choice, "type", str, where=f"{path}.")
        if kind == "function":
            name = get(get(choice, "function", dict, where=f"{path}."), "name", str, where=f"{path}.function.")
            return _mode("required", [_named(defs, name, f"{path}.function.name")], parallel)
        if kind == "allowed_tools":
            allowed = get(choice, "allowed_tools", dict, where=f"{path}.")
            where = f"{path}.allowed_tools."
            mode = get(allowed, "mode", str, "auto", where=where)
            if mode not in ("auto", "required"):
                raise BadRequest(f"'{where}mode' must be auto or required, not {mode!r}", f"{where}mode")
            subset = []
            for i, t in enumerate(get(allowed, "tools", list, where=where)):
                at = f"{where}tools[{i}]"
                fn = _obj(_obj(t, at).get("function", t), at)  # {"type": "function", "function": {"name"}} or {"name"}
                subset.append(_named(defs, get(fn, "name", str, where=f"{at}."), at))
            return _mode(mode, subset, parallel)
        raise BadRequest(f"'{path}.type' must be function or allowed_tools, not {kind!r}", f"{path}.type")
    if choice not in ("none", "auto", "required"):
        raise BadRequest(f"'{path}' must be none, auto, required or an object naming a function, not {choice!r}",
                         path)
    if choice == "required" and not defs:
        raise BadRequest(f"'{path}' is required but no 'tools' are given", path)
    return _mode(choice, [] if choice == "none" else defs, parallel)


def _mode(choice: str, defs: list[dict], parallel: bool) -> tuple[OutputConstraint | None, ToolMode]:
    """The constraint and mode of `choice` (none, auto or required) over the tools `defs`."""
    if not defs or choice == "none":
        return None, NO_TOOLS
    tools = _template_tools(defs)
    if choice == "auto":
        return None, ToolMode("auto", tools, parallel)
    return _forced(defs, parallel), ToolMode("forced", tools, parallel)


def _obj(value, path: str) -> dict:
    if not isinstance(value, dict):
        raise BadRequest(f"'{path}' must be an object", path)
    return value


def _name(tool) -> str | None:
    return tool.get("function", {}).get("name") if isinstance(tool, dict) else None


def _function_tools(tools) -> list[dict]:
    """The request's function tools, checked: {"type": "function", "function": {"name",
    "parameters"?, "strict"?}} each (the keys the template and the constraint read)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _obj(tool, where)
        if get(tool, "type", str, "function", where=f"{where}.") != "function":
            raise BadRequest(f"'{where}.type': only function tools are supported, not {tool['type']!r}",
                             f"{where}.type")
        fn = get(tool, "function", dict, where=f"{where}.")
        get(fn, "name", str, where=f"{where}.function.")
        get(fn, "parameters", dict, {}, where=f"{where}.function.")
        get(fn, "strict", bool, False, where=f"{where}.function.")
        out.append(tool)
    return out


def _template_tools(defs: list[dict]) -> list[dict]:
    """The tool definitions as the chat template takes them."""
    return [{"type": "function", "function": d["function"]} for d in defs]


def _named(defs: list[dict], name: str, path: str) -> dict:
    for d in defs:
        if d["function"]["name"] == name:
            return d
    known = ", ".join(repr(d["function"]["name"]) for d in defs) or "none"
    raise BadRequest(f"'{path}': no tool named {name!r} in 'tools' (given: {known})", path)


def _forced(chosen: list[dict], parallel: bool) -> OutputConstraint:
    """The JSON Schema of a forced reply: a call of one of the tools `chosen`, `{"name": NAME,
    "arguments": PARAMETERS}`, or an array of 1..N calls where `parallel`. A tool's
    own `$defs` and `$ref`s are moved under the root's (see `_hoisted`)."""
    root_defs: dict = {}
    calls = []
    try:  # the walks recurse: parameters nested near the body's own limit would overflow
        for i, d in enumerate(chosen):
            params = d["function"].get("parameters") or {"type": "object"}
            calls.append({"type": "object", "properties": {"name": {"const": d["function"]["name"]},
                                                            "arguments": _hoisted(params, f"tool{i}", root_defs)},
                          "required": ["name", "arguments"], "additionalProperties": False})
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": call, "minItems": 1} if parallel else call
        if root_defs:
            schema = {**schema, "$defs": root_defs}
        return OutputConstraint("json_schema", json.dumps(schema))
    except RecursionError:
        raise BadRequest("'tools': a tool's parameters are nested too deeply", "tools") from None


def _hoisted(schema: dict, prefix: str, root_defs: dict) -> dict:
    """`schema` placed inside another, its references kept pointing where they did: a
    schema without `$ref` as it is; else itself as the root's `$defs[prefix]`, its own
    `$defs`/`definitions` as `$defs[prefix__NAME]`, each `$ref` rewritten to match."""
    if not _has_ref(schema):
        return schema
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    for group in ("$defs", "definitions"):
        for name, sub in (schema.get(group) or {}).items():
            root_defs[f"{prefix}__{_pointer_escape(name)}"] = _rewrite(sub, prefix)
    root_defs[prefix] = _rewrite(body, prefix)
    return {"$ref": f"#/$defs/{prefix}"}


def _has_ref(value) -> bool:
    if isinstance(value, dict):
        return isinstance(value.get("$ref"), str) or any(_has_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_ref(v) for v in value)


def _rewrite(value, prefix: str):
    """A copy of `value` with each local `$ref` moved under the root's `$defs`."""
    if isinstance(value, list):
        return [_rewrite(v, prefix) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: _rewrite(v, prefix) for k, v in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        pointer = ref[1:]
        for group in ("/$defs/", "/definitions/"):
            if pointer.startswith(group):
                name, _, rest = pointer[len(group):].partition("/")
                out["$ref"] = f"#/$defs/{prefix}__{name}" + (f"/{rest}" if rest else "")
                break
        else:
            out["$ref"] = f"#/$defs/{prefix}{pointer}"
    return out


def _pointer_escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def extension_constraints(body: dict) -> list[tuple[str, OutputConstraint]]:
    """The constraints the extensions in `body` ask for, each with its field:
    llama-server's `grammar` (GBNF) and `json_schema`, `regex`, vLLM's
    `structured_outputs` (one of json, regex, grammar, choice, json_object) and its
    older `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`."""
    found = []
    if body.get("grammar") is not None:
        found.append(("grammar", OutputConstraint("gbnf", get(body, "grammar", str))))
    if body.get("json_schema") is not None:
        found.append(("json_schema", schema_constraint(body["json_schema"], "json_schema")))
    if body.get("regex") is not None:
        found.append(("regex", OutputConstraint("regex", get(body, "regex", str))))
    if body.get("structured_outputs") is not None:
        found += _vllm(get(body, "structured_outputs", dict), "structured_outputs.")
    found += _vllm({k.removeprefix("guided_"): v for k, v in body.items()
                    if k in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")}, "guided_")
    return found


def _vllm(spec: dict, where: str) -> list[tuple[str, OutputConstraint]]:
    """vLLM's structured_outputs keys (`where`: the field's prefix for errors)."""
    found = []
    for key in ("json", "regex", "grammar", "choice", "json_object"):
        value = spec.get(key)
        if value is None or value is False:
            continue
        path = f"{where}{key}"
        if key == "json":
            found.append((path, schema_constraint(value, path)))
        elif key == "json_object":
            found.append((path, OutputConstraint("json_object")))
        elif key == "choice":
            found.append((path, OutputConstraint("regex", choice_regex(value, path))))
        else:
            if not isinstance(value, str):
                raise BadRequest(f"'{path}' must be a string", path)
            found.append((path, OutputConstraint("regex" if key == "regex" else "gbnf", value)))
    return found


def choice_regex(choices, path: str = "choice") -> str:
    """A regex matching exactly one of `choices` (literal strings)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise BadRequest(f"'{path}' must be a non-empty array of strings", path)
    return "(" + "|".join("".join("\\" + ch if ch in REGEX_SPECIAL else ch for ch in c) for c in choices) + ")"


def openai_structure(body: dict, opts: Options, chat: bool = True) -> Options:
    """`opts` with the constraint and tool mode an OpenAI request asks for
    (/v1/completions: response_format and the extensions; no tools)."""
    found = []
    fmt = response_format_constraint(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    found += extension_constraints(body)
    mode = NO_TOOLS
    if chat:
        forced, mode = tool_choice_constraint(body.get("tools"), body.get("tool_choice"),
                                              get(body, "parallel_tool_calls", bool, True))
        if forced is not None:
            found.append(("tool_choice", forced))
    return _with(opts, found, mode)


def _with(opts: Options, found: list[tuple[str, OutputConstraint]], mode: ToolMode) -> Options:
    """`opts` with the one constraint in `found` (two: a 400 naming both) and `mode`."""
    if len(found) > 1:
        names = " and ".join(f"'{field}'" for field, _ in found)
        raise BadRequest(f"{names} each constrain the reply: send at most one of them", found[1][0],
                         code="conflicting_constraints")
    field, constraint = found[0] if found else (None, None)
    return replace(opts, sampling=replace(opts.sampling, constraint=constraint), constraint_field=field,
                   tools=mode.tools, tool_mode=mode)


# -- Ollama ------------------------------------------------------------------------------
def ollama_format_constraint(fmt, path: str = "format") -> OutputConstraint | None:
    """Ollama's `format`: "json" is any JSON object, an object a JSON Schema; "" or absent free text."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return OutputConstraint("json_object")
    if isinstance(fmt, dict):
        return schema_constraint(fmt, path)
    raise BadRequest(f"'{path}' must be \"json\" or a JSON Schema object", path)


def ollama_structure(body: dict, opts: Options) -> Options:
    """`opts` with the constraint of an Ollama request's `format`; tools, when given,
    are called as the model decides (Ollama has no tool_choice)."""
    fmt = ollama_format_constraint(body.get("format"))
    mode = ToolMode("auto", opts.tools, True) if opts.tools else NO_TOOLS
    return _with(opts, [("format", fmt)] if fmt is not None else [], mode)


# -- Anthropic ---------------------------------------------------------------------------
def anthropic_format_constraint(body: dict) -> tuple[str, OutputConstraint] | None:
    """Anthropic's `output_config.format` ({"type": "json_schema", "schema"}: what
    `messages.parse(output_format=...)` sends) or the older beta's top-level `output_format`."""
    config = get(body, "output_config", dict, {})
    for path, fmt in (("output_config.format", config.get("format")), ("output_format", body.get("output_format"))):
        if fmt is None:
            continue
        _obj(fmt, path)
        kind = get(fmt, "type", str, where=f"{path}.")
        if kind != "json_schema":
            raise BadRequest(f"'{path}.type' must be json_schema, not {kind!r}", f"{path}.type")
        return path, schema_constraint(get(fmt, "schema", (dict, str), where=f"{path}."), f"{path}.schema")
    return None


def anthropic_structure(body: dict, opts: Options) -> Options:
    """`opts` with the constraint and tool mode of an Anthropic request: its output
    format, and tool_choice any (a call of any tool) or tool (that one) forced as
    OpenAI's required and named function are; auto and none as OpenAI's."""
    found = []
    fmt = anthropic_format_constraint(body)
    if fmt is not None:
        found.append(fmt)
    choice = get(body, "tool_choice", dict, {"type": "auto"})
    kind = get(choice, "type", str, where="tool_choice.")
    openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": get(choice, "name", str, where="tool_choice.")}}
    elif openai_choice is None:
        raise BadRequest(f"'tool_choice.type' must be auto, any, tool or none, not {kind!r}", "tool_choice.type")
    parallel = not get(choice, "disable_parallel_tool_use", bool, False, where="tool_choice.")
    forced, mode = tool_choice_constraint(opts.tools, openai_choice, parallel)
    if forced is not None:
        found.append(("tool_choice", forced))
    return _with(opts, found, mode)


# -- checking ----------------------------------------------------------------------------
def check(engine, opts: Options) -> None:
    """Compile `opts`' constraint once (engine.grammars; off the event loop: it may take
    up to the compile limit), so a grammar that cannot be followed is a 400 before any
    work, naming the field it came from."""
    constraint = opts.sampling.constraint
    if constraint is None:
        return
    try:
        engine.grammars.check(constraint)
    except GrammarError as e:
        raise BadRequest(f"{opts.constraint_field}: {e}", opts.constraint_field, code=e.code) from None
