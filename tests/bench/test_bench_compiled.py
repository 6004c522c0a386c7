"""bench.compiled: a decode step with every layer's MLP under mx.compile gives exactly the
uncompiled step's tokens and logits, and both are timed side by side."""


def test_the_compiled_decode_step_equals_the_plain_one(tiny_llama_dir, tmp_path, monkeypatch):
    from bench import compiled
    from justfit.model import native_layers

    plain_call = native_layers.NativeLlamaMLP.__call__
    row = compiled.run(str(tiny_llama_dir), context=40, steps=6, rounds=2)
    assert row["equal"] and row["steps"] == 12 and row["compiled_layers"] > 0
    assert row["plain_step_ms"] > 0 and row["compiled_step_ms"] > 0 and row["trace_s"] > 0
    assert native_layers.NativeLlamaMLP.__call__ is plain_call  # the class is left as it was
