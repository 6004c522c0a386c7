"""JSON from an untrusted file, parsed within bounds: nesting checked before parsing
(without recursion), integers of bounded length, no NaN or Infinity, no key twice in one
object. What the snapshot reader (statetrans.snapshot) parses manifests with."""

from __future__ import annotations

import json
import math
import re


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a snapshot holds")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


def _unique_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice in one object")
    return out


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SQUARE = str.maketrans("{}", "[]")


def _depth_within(text: str, limit: int) -> bool:
    """Whether JSON `text` nests objects and arrays at most about `limit` deep, found
    without recursion: strings removed, then innermost bracket pairs, one level per
    pass. Unbalanced text (not JSON) passes if shallow: the parser says what is wrong."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).translate(_SQUARE)
    for _ in range(limit):
        shorter = brackets.replace("[]", "")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    else:
        if "[]" in brackets:
            return False
    return brackets.count("[") <= limit


def bounded_loads(text: str, max_depth: int, max_digits: int):
    """`text` parsed as JSON nested at most about `max_depth` deep, integers of at most
    `max_digits` digits, finite numbers, unique keys; ValueError otherwise."""
    if not _depth_within(text, max_depth):
        raise ValueError(f"nested more than {max_depth} deep")

    def bounded_int(digits: str) -> int:
        if len(digits.lstrip("-")) > max_digits:
            raise ValueError(f"an integer of {len(digits)} digits")
        return int(digits)

    return json.loads(text, parse_constant=_refuse_constant, parse_int=bounded_int, parse_float=_finite_float,
                      object_pairs_hook=_unique_keys)
