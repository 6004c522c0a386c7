"""What a stored state must be for this engine to use it, checked on the manifest and
the arrays file's header before any array is read: token ids below the vocabulary,
one layer per model layer, every layer's metadata and arrays as statetrans.state and
kvexec.export write them (statetrans.state.check_layers), each layer holding exactly
the positions of its tokens, and paged layers laid out by the manifest's own KV
configuration (the engine's, which identity checks), so nothing a file says can size
an allocation beyond what this engine would make itself."""

from __future__ import annotations

from dataclasses import dataclass

from kvexec.export import KIND as PAGED
from statetrans.snapshot import TOKEN_LIMIT, Shapes, SnapshotError, check_tokens
from statetrans.state import check_layers, saved_offset

# KV settings that size a paged layer's storage: each layer's must be the manifest's.
_SIZING = ("page_size", "hot_window", "full_bits", "sink_tokens", "block_tokens", "max_positions", "select_pages")


@dataclass(frozen=True)
class Expect:
    """What this engine's states hold: its layer count and vocabulary, where known."""

    layers: int | None = None
    vocab: int | None = None


def check_state(manifest: dict, shapes: Shapes, expect: Expect, where: str) -> None:
    """Raise SnapshotError (naming `where`) unless `manifest` with arrays of `shapes`
    is a state this engine can continue (see the module doc)."""
    try:
        tokens = manifest.get("tokens")
        check_tokens(tokens, min(TOKEN_LIMIT, expect.vocab or TOKEN_LIMIT))
        layers = manifest.get("layers")
        check_layers(layers, shapes, expect.layers)
        kv = manifest.get("kv")
        for i, layer in enumerate(layers):
            if layer["kind"] == PAGED and (not isinstance(kv, dict) or any(
                    layer["config"][k] != kv.get(k) for k in _SIZING)):
                raise ValueError(f"layer {i}'s pages are laid out otherwise than the manifest's KV settings say")
            offset = saved_offset(layer)
            if offset is not None and offset != len(tokens):
                raise ValueError(f"layer {i} holds {offset} positions for {len(tokens)} tokens")
    except ValueError as e:
        raise SnapshotError(f"{where}: state does not match its tokens or this model's layers ({e})") from None
