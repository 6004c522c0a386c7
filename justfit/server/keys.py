"""API keys: the ones a server accepts (`--api-key`, repeatable, and `--api-keys FILE`),
the key a request presents, and the scope it stands for.

A presented key is compared with every accepted key, each through its SHA-256 digest
and `hmac.compare_digest`, so neither the time taken nor an early exit tells which key
(or how much of one) matched. A request's scope is the first 16 hex digits of its
key's SHA-256: stable across restarts, never the key itself, and what stored state is
filed under (justfit.server.sessions); "" on a server without keys."""

from __future__ import annotations

import hashlib
import hmac
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from aiohttp import web

KEY = re.compile(r"[!-~]+")
SCOPE = web.RequestKey("scope", str)  # where the auth middleware leaves a request's scope  # printable ASCII without spaces: what a header carries as it is


def scope(key: str) -> str:
    """The scope a key stands for (not the key: a digest of it)."""
    return _digest(key).hex()[:16]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def accepted(api_key: str | None, api_keys: Iterable[str]) -> tuple[str, ...]:
    """Every key a server accepts, once each: `api_keys` and the single `api_key`."""
    return tuple(dict.fromkeys([*api_keys, *([api_key] if api_key else [])]))


def presented(headers) -> list[str]:
    """The keys a request carries: `Authorization: Bearer KEY` (OpenAI's clients) and
    `x-api-key: KEY` (Anthropic's)."""
    out = []
    auth_scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    if auth_scheme.lower() == "bearer" and token.strip():
        out.append(token.strip())
    if headers.get("X-Api-Key"):
        out.append(headers["X-Api-Key"].strip())
    return out


def match(candidates: Iterable[str], keys: tuple[str, ...]) -> str | None:
    """The scope of the accepted key among `candidates`, or None; every pair is
    compared, whatever matched first."""
    digests = _digests(keys)
    found = None
    for candidate in candidates:
        given = _digest(candidate)
        for digest in digests:
            if hmac.compare_digest(given, digest):
                found = digest
    return None if found is None else found.hex()[:16]


@lru_cache(maxsize=4)
def _digests(keys: tuple[str, ...]) -> tuple[bytes, ...]:
    return tuple(_digest(k) for k in keys)


def check(key: str, where: str) -> str:
    """`key`, or ValueError saying what is wrong with it and where it came from."""
    if not KEY.fullmatch(key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces")
    return key


def read_file(path: str | Path) -> tuple[str, ...]:
    """The keys in a file, one a line; blank lines and lines starting with '#' are
    skipped. ValueError (saying why) when it cannot be read or holds no key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise ValueError(f"cannot read the API key file {path}: {reason}") from None
    keys = [check(line.strip(), f"{path} line {n}") for n, line in enumerate(text.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path} holds no key (one key a line; '#' starts a comment)")
    return tuple(dict.fromkeys(keys))
