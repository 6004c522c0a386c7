"""Stop strings in a token stream: emit text as soon as it cannot begin a stop."""

from __future__ import annotations


class StopMatcher:
    """Stop strings over streamed text: holds back what could still begin one."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.hit: str | None = None  # the stop string found, once one is

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit).
        On a hit, the returned text is everything before the stop string."""
        buf = self._pending + text
        if not self.stops:
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            at = min(hits)
            self.hit = next(s for s in self.stops if buf.find(s) == at)
            return buf[:at], True
        keep = 0  # longest tail of buf that could still grow into a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self, text: str = "") -> str:
        """The held-back text once the stream ended without a stop."""
        out, hit = self.feed(text)
        rest, self._pending = self._pending, ""
        return out if hit else out + rest


class ReplyText:
    """One reply's tokens turned into text: end-of-sequence, detokenizing, stop strings
    and the token limit, with the counts and finish kept in `stats` (GenerationStats).
    Every request's decoder (justfit.engine.decoder) emits through it."""

    def __init__(self, tokenizer, sp, stats):
        self.detok = tokenizer.detokenizer  # mlx-lm hands each caller its own copy
        self.detok.reset()
        self.stops = StopMatcher(sp.stop)
        self.eos = set() if sp.ignore_eos else set(tokenizer.eos_token_ids)
        self.max_tokens, self.stats = sp.max_tokens, stats
        self.reason: str | None = None  # "stop" or "length" once the reply ended

    def add(self, token: int) -> str | None:
        """The text `token` lets out now ("" while a character or a possible stop
        string is incomplete), or None when it is end-of-sequence (never counted or
        shown). After either, `reason` says whether the reply ended."""
        if token in self.eos:
            self.reason = "stop"
            return None
        self.stats.generated_tokens += 1
        self.detok.add_token(token)
        text, hit = self.stops.feed(self.detok.last_segment)
        if hit:
            self.reason = "stop"
        elif self.stats.generated_tokens >= self.max_tokens:
            self.reason = "length"
        return text

    def end(self) -> str:
        """Close the reply (a "length" finish when nothing else ended it); the text
        held back until now."""
        self.reason = self.reason or "length"
        self.detok.finalize()
        tail = self.stops.flush(self.detok.last_segment) if self.reason == "length" else ""
        self.stats.finish_reason, self.stats.stop_sequence = self.reason, self.stops.hit
        return tail
