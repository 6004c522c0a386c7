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
