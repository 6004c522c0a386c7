"""What a constraint means to the engine (justfit.engine.grammar): an object schema that
lists its properties and says nothing of others allows no others (`closed_objects`), as
llama.cpp's and xgrammar's JSON Schema converters and OpenAI's strict mode read it
(pydantic's schemas, which never say, otherwise let a small model add keys until its
token limit); and a grammar that compiles but matches no text is refused when checked,
never an error in the middle of a reply."""

from __future__ import annotations

import json
from typing import Optional

import llguidance
from pydantic import BaseModel

import pytest

from justfit.config import OutputConstraint
from justfit.engine.grammar import closed_objects, compile_entry, grammar_text
from justfit.errors import GrammarError


class Inner(BaseModel):
    """A nested model, reached through $defs and $ref."""

    city: str


class Outer(BaseModel):
    """A model with a nested one, a list of them and an Optional."""

    name: str
    home: Inner
    past: list[Inner]
    nick: Optional[str] = None


def _bytes_tokenizer():
    """llguidance's tokenizer for a vocabulary of the 256 bytes and an end token."""
    class Bytes:
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

        def __call__(self, s):
            return list(s.encode() if isinstance(s, str) else s)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def _accepts(schema: dict, text: str) -> bool:
    """Whether the engine's grammar for `schema` takes all of `text` and may end there."""
    tokenizer = _bytes_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(OutputConstraint("json_schema", json.dumps(schema))))
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def test_pydantic_objects_are_closed_everywhere_and_the_input_untouched():
    schema = Outer.model_json_schema()
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before  # a copy: the caller's schema is not changed
    assert closed["additionalProperties"] is False and closed["$defs"]["Inner"]["additionalProperties"] is False
    assert _accepts(schema, '{"name":"a","home":{"city":"b"},"past":[{"city":"c"}]}')
    assert not _accepts(schema, '{"name":"a","home":{"city":"b"},"past":[],"extra":1}')
    assert not _accepts(schema, '{"name":"a","home":{"city":"b","zip":"1"},"past":[]}')


def test_what_the_schema_says_stands():
    """additionalProperties given (true or a schema), patternProperties, an object with
    no properties listed (any object), and allOf's members keep their meaning."""
    given = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert closed_objects(given) == given
    assert _accepts(given, '{"a":1,"b":"x"}') and not _accepts(given, '{"a":1,"b":2}')
    assert closed_objects({"type": "object"}) == {"type": "object"}
    assert _accepts({"type": "object"}, '{"anything":[1,2]}')
    patterned = {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {}}}
    assert "additionalProperties" not in closed_objects(patterned)
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert _accepts(merged, '{"a":1,"b":2}')  # closed members would forbid each other's keys


@pytest.mark.parametrize("constraint", [OutputConstraint("gbnf", "root ::= root"),
                                        OutputConstraint("lark", "start: start"),
                                        OutputConstraint("json_schema", '{"not": {}}')])
def test_a_grammar_that_matches_nothing_is_refused(constraint):
    entry = compile_entry(_bytes_tokenizer(), constraint)
    assert entry.matcher is None and isinstance(entry.error, GrammarError)


def test_a_grammar_that_matches_something_compiles():
    entry = compile_entry(_bytes_tokenizer(), OutputConstraint("gbnf", 'root ::= "a"+'))
    assert entry.error is None and entry.matcher is not None and not entry.matcher.is_error()
