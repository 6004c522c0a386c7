"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content` entries,
and the legacy completions' parallel arrays."""

from __future__ import annotations


def token_text(tokenizer, token: int) -> str:
    """A token as text (a partial UTF-8 sequence shows as U+FFFD, as OpenAI's do)."""
    return tokenizer.decode([token])


def chat_entry(tokenizer, chunk) -> dict:
    """One generated token's entry in a chat choice's `logprobs.content`."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**item(chunk.token, chunk.logprob),
            "top_logprobs": [item(t, lp) for t, lp in chunk.top_logprobs or []]}


def chat_entries(tokenizer, chunks: list) -> list[dict]:
    """The entries of the chunks that carry a logprob, in order."""
    return [chat_entry(tokenizer, c) for c in chunks if c.logprob is not None]


def chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's `logprobs` object holding `entries`."""
    return {"content": entries, "refusal": None}


def completion_logprobs(entries: list[dict], start_offset: int = 0) -> dict:
    """The completions API's arrays from chat-shaped entries; offsets count characters
    from `start_offset`."""
    offsets, at = [], start_offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
