"""Tiny random-weight mlx-lm models on KVExec's paged caches, and a byte tokenizer for them."""

from __future__ import annotations


class ByteTokenizer:
    """Text as its UTF-8 bytes: a tiny model's vocabulary of the 256 byte values."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def paged_model(config: dict, seed: int = 0):
    """An mlx-lm model of `config` with random float32 weights and KVExec's paged caches."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    import kvexec

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.apply(lambda a: a.astype(mx.float32))
    mx.eval(model.parameters())
    kvexec.install(model)
    return model
