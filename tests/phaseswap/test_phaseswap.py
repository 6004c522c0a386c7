"""PhaseSwap: leases, release, offloading, policies, forms and `justfit fit`; under a
budget: tests/phaseswap/test_phaseswap_budget.py."""

import gc

import mlx.core as mx
import pytest

from justfit import Engine, SamplingParams
from justfit.config import EngineConfig
from phaseswap import POLICIES, PhaseSwap, Residency, TransposedQuantizedLinear
from phaseswap.forms import DenseWhileUsed, get_module, set_module, to_dense


def _swap(path, policy="cpu", tmp=None):
    from mlx_lm.utils import load

    model, _ = load(str(path), lazy=True)
    return model, PhaseSwap(model, policy, tmp)


def _settled_active() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def test_cpu_policy_components_and_forms(q8_dir):
    model, swap = _swap(q8_dir)
    reg = swap.registry
    assert list(reg.components) == ["embed", "layer.0", "layer.1", "layer.2", "layer.3", "head"]
    assert isinstance(model.model.layers[0].mlp.up_proj, TransposedQuantizedLinear)
    assert isinstance(model.model.embed_tokens.head, TransposedQuantizedLinear)
    assert set(reg.states().values()) == {"resident"}
    assert swap.prefill_forms == {f"layer.{i}": "dense" for i in range(4)}
    assert reg.resident_bytes() == reg.total_bytes() > 0


def test_dense_lease_materializes_and_release_gives_memory_back(q8_dir):
    _, swap = _swap(q8_dir)
    reg = swap.registry
    comp = reg.components["layer.1"]
    x = mx.random.normal((1, 16, 64), key=mx.random.key(1))
    stash = {p: get_module(comp.module, p) for p in comp.linears()}
    for p, mod in stash.items():  # the layer with every linear's dense copy held together
        set_module(comp.module, p, to_dense(mod))
    expected = comp.module(x, None, None)
    mx.eval(expected)
    for p, mod in stash.items():
        set_module(comp.module, p, mod)
    before = _settled_active()
    with reg.lease("layer.1", "dense") as layer:
        assert isinstance(layer.mlp.up_proj, DenseWhileUsed)
        assert comp.state == Residency.MATERIALIZED
        out = layer(x, None, None)
        mx.eval(out)
    assert mx.array_equal(out, expected).item()  # the same products, bit for bit
    assert comp.state == Residency.RESIDENT
    assert isinstance(comp.module.mlp.up_proj, TransposedQuantizedLinear)
    assert _settled_active() == before + out.nbytes  # the working copies went with the lease
    assert reg.counters.materialized_bytes == reg.counters.released_bytes == comp.dense_nbytes


def test_a_dense_lease_holds_one_linear_at_a_time():
    import mlx.nn as nn

    def quantized(n_in, n_out, seed):
        layer = nn.Linear(n_in, n_out, bias=False)
        layer.weight = mx.random.normal((n_out, n_in), key=mx.random.key(seed))
        q = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
        mx.eval(q.parameters())
        return q

    gate, up, down = quantized(256, 1024, 1), quantized(256, 1024, 2), quantized(1024, 256, 3)
    x = mx.random.normal((1, 8, 256), key=mx.random.key(4))
    mx.eval(x)
    peaks, outs = [], []
    for make in (to_dense, DenseWhileUsed):
        g, u, d = make(gate), make(up), make(down)
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        outs.append(d(nn.silu(g(x)) * u(x)))
        mx.eval(outs[-1])
        peaks.append(mx.get_peak_memory() - before)
        del g, u, d
    one = 256 * 1024 * 4  # one dense weight
    # held together, against one at a time (with its product and, on MLX's own kernels, a temporary)
    assert peaks[0] >= 3 * one and peaks[1] < 2.5 * one
    assert mx.array_equal(*outs).item()


def test_a_dense_lease_computes_its_input_before_its_dense_copy():
    """What a lazy input is computed from (an MLP's gate and up) is freed before the
    dense copy exists: the lease peaks as it does on an input computed beforehand."""
    import mlx.nn as nn

    layer = nn.Linear(1024, 256, bias=False)
    layer.weight = mx.random.normal((256, 1024), key=mx.random.key(1))
    lease = DenseWhileUsed(nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4))
    mx.eval(lease.parameters())

    def peak(computed: bool):
        gate, up = (mx.random.normal((1, 256, 1024), key=mx.random.key(k)) for k in (2, 3))
        h = gate * up  # one operation: MLX would build the dense copy's deeper graph first
        if computed:
            mx.eval(h)
        del gate, up  # held by h's graph alone, or freed
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        out = lease(h)
        return mx.get_peak_memory(), out

    (lazy, out), (computed, expected) = peak(False), peak(True)
    one = 1024 * 256 * 4  # the dense weight, and each of gate, up and h
    # gate and up beside the dense copy would add a weight's bytes at least (native
    # dequantization: 1.0, MLX's own with its temporary: 1.0 as well)
    assert lazy <= computed + 0.1 * one, (lazy - computed) / one
    assert mx.array_equal(out, expected).item()


def test_offloaded_layer_holds_no_memory_and_computes_the_same(q8_dir, tmp_path):
    model, swap = _swap(q8_dir, tmp=tmp_path)
    reg = swap.registry
    x = mx.random.normal((1, 5, 64))
    expected = model.model.layers[2](x, None, None)
    mx.eval(expected)
    before = _settled_active()
    swap.offload(["layer.2"])
    assert reg.components["layer.2"].state == Residency.DISK
    assert before - _settled_active() == reg.components["layer.2"].nbytes
    assert (tmp_path / "layer.2.safetensors").is_file()
    out = model.model.layers[2](x, None, None)  # read from disk for this call only
    assert mx.array_equal(out, expected)
    assert reg.counters.disk_loads == 1 and reg.counters.disk_read_bytes == reg.components["layer.2"].nbytes
    del out
    assert before - _settled_active() == reg.components["layer.2"].nbytes
    swap.offload([])
    assert reg.components["layer.2"].state == Residency.RESIDENT and _settled_active() == before


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_generates_like_dense(q8_dir, policy):
    cfg = dict(temperature=0, max_tokens=8, ignore_eos=True)
    ref = Engine(str(q8_dir), config=EngineConfig(policy="dense"))
    eng = Engine(str(q8_dir), config=EngineConfig(policy=policy))
    prompt = "one two three four five six"
    # q8t re-quantizes the stored 8-bit weights: close, not identical, so compare logits.
    a = [c.token for c in ref.generate(prompt, SamplingParams(**cfg)) if c.token is not None]
    b = [c.token for c in eng.generate(prompt, SamplingParams(**cfg)) if c.token is not None]
    assert len(a) == len(b) == 8
    assert sum(x == y for x, y in zip(a, b)) >= 6, (a, b)


def test_phase_stats_report_materialization(q8_dir):
    eng = Engine(str(q8_dir), config=EngineConfig(policy="cpu", prefill_chunk=8))
    chunks = list(eng.generate("a prompt of several chunks", SamplingParams(temperature=0, max_tokens=3)))
    prefill, decode = chunks[-1].stats.phases
    assert (prefill.name, decode.name) == ("prefill", "decode")
    layers = eng.swap.registry.layers
    per_pass = sum(eng.swap.registry.components[n].dense_nbytes for n in layers)
    # Every full body chunk materializes every layer; shorter pieces (the tail, the
    # last token) run on the resident q8t form.
    full_chunks = (chunks[-1].stats.prompt_tokens - 1) // 8
    assert full_chunks >= 2
    assert prefill.materialized_bytes == prefill.released_bytes == full_chunks * per_pass
    assert decode.materialized_bytes == 0 and decode.disk_loads == 0
    assert prefill.seconds > 0 and prefill.peak_bytes > 0 and decode.resident_components == 6


def test_serving_never_draws_from_mlx_global_random_key(q8_dir):
    # Each draw from MLX's global key lengthens its lazy graph (nothing evaluates it):
    # made per prefill chunk, the dense leases' layers kept memory per prefilled token.
    eng = Engine(str(q8_dir), config=EngineConfig(policy="cpu", prefill_chunk=8))
    key = mx.random.state[0]
    for prompt, sp in (("a prompt of several chunks, each leased dense", SamplingParams(temperature=0, max_tokens=4)),
                       ("another prompt, sampled this time, also chunked",
                        SamplingParams(temperature=0.8, max_tokens=4, seed=3))):
        chunks = list(eng.generate(prompt, sp))
        assert chunks[-1].stats.phases[0].materialized_bytes > 0  # the dense leases ran
    assert mx.random.state[0] is key


def test_measured_policy_picks_a_form_per_layer(q8_dir):
    _, swap = _swap(q8_dir, "measured")
    assert set(swap.prefill_forms) == set(swap.registry.layers)
    assert set(swap.prefill_forms.values()) <= {"dense", "resident"}


def test_tight_budget_streams_and_generates_identically(q8_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JUSTFIT_CACHE", str(tmp_path))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = Engine(str(q8_dir))
    expected = [c.token for c in free.generate("stream me please", sp)]
    weights = free.swap.registry.total_bytes()
    positions = len(free.encode("stream me please")) + 6
    budget = free.planner.footprint(positions, dense_prefill=False).total - weights // 2  # half the weights must live on disk
    del free
    others = _settled_active()  # MLX memory is per process: earlier tests' arrays count too
    tight = Engine(str(q8_dir), budget=budget, config=EngineConfig(policy="cpu"))  # free's weights
    offloaded, fp = tight.planner.plan(positions)
    assert offloaded and fp.total <= budget and fp.weights < weights
    chunks = list(tight.generate("stream me please", sp))
    assert [c.token for c in chunks] == expected
    stats = chunks[-1].stats
    assert stats.phases[0].disk_loads > 0 and stats.phases[1].offloaded_components == len(offloaded)
    assert stats.memory.mlx_peak - others <= budget


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        EngineConfig(policy="fast")


def test_justfit_fit_reports_formats_and_plan(q8_dir):
    import json

    from click.testing import CliRunner

    from cli.main import main

    runner = CliRunner()
    res = runner.invoke(main, ["fit", "--model", str(q8_dir), "--budget", "64MiB", "--context", "300", "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    rows = {row["format"]: row for row in r["formats"]}
    # head_dim 16 is too small for the quantized ones: calibration (the default) falls back to fp16;
    # then the other programs' rows, each named for its KV (the engine computes in fp32 here)
    assert set(rows) == {"fp32", "fp16", "calibrated: fp16 x4", "mlx-lm fp16", "mlx-lm fp32", "llama.cpp f16",
                         "llama.cpp q8_0"} and r["kv_format"] == "calibrated"
    assert rows["calibrated: fp16 x4"]["bytes_per_position"] == rows["fp16"]["bytes_per_position"]
    assert rows["fp16"]["bytes_per_position"] * 2 == rows["fp32"]["bytes_per_position"]
    assert rows["fp16"]["max_positions"] > max(rows["fp32"]["max_positions"], rows["mlx-lm fp32"]["max_positions"])
    assert all(row["max_positions_offloaded"] >= row["max_positions"]
               for row in rows.values() if not row.get("compare"))  # the others stream no layers
    assert r["plan"]["positions"] == 300 and r["plan"]["footprint"]["total"] <= 64 * 2**20 and r["plan"]["fits"]
    text = runner.invoke(main, ["fit", "--model", str(q8_dir), "--budget", "300KiB", "--context", "500"]).output
    assert "does NOT fit" in text and "policy cpu" in text and "fp16" in text


def test_justfit_fit_takes_the_process_off_a_whole_process_budget(q8_dir):
    import json

    from click.testing import CliRunner

    from cli.main import main

    runner = CliRunner()
    args = ["fit", "--model", str(q8_dir), "--budget", "2GiB", "--json"]
    engine_only = json.loads(runner.invoke(main, args).output)
    res = runner.invoke(main, [*args, "--whole-process"])
    assert res.exit_code == 0, res.output
    whole = json.loads(res.output)
    assert whole["outside"] > 0 and whole["budget"] + whole["outside"] == engine_only["budget"] == 2 * 2**30
    fewer = {r["format"]: r["max_positions"] for r in whole["formats"]}
    assert all(fewer[r["format"]] < r["max_positions"] for r in engine_only["formats"])
    text = runner.invoke(main, ["fit", "--model", str(q8_dir), "--budget", "1MiB", "--whole-process"]).output
    assert "is no more than what the process holds besides the engine" in text
    text = runner.invoke(main, ["fit", "--config", str(q8_dir), "--whole-process"]).output
    assert "give --model, not --config" in text


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (4, 64)])
def test_grouped_form_is_exact(bits, group):
    from phaseswap.forms import GroupedQuantizedLinear, dense_weight, to_grouped
    import mlx.nn as nn

    mx.random.seed(bits + group)
    lin = nn.QuantizedLinear(128, 96, bias=True, group_size=group, bits=bits)
    lin.update({"bias": mx.random.normal((96,))})
    lin.apply(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)
    grouped = to_grouped(lin)
    assert isinstance(grouped, GroupedQuantizedLinear)
    w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=group, bits=bits)
    assert mx.allclose(dense_weight(grouped), w, rtol=0, atol=1e-6)  # the stored values, recovered
    for rows in (1, 5):
        x = mx.random.normal((2, rows, 128))
        ref = x @ w.T + lin.bias
        assert mx.allclose(grouped(x), ref, rtol=1e-5, atol=1e-5)
