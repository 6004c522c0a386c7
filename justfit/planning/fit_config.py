"""`justfit fit --config`: what a model would need, from its Hugging Face config.json
alone, before any weight is downloaded. Parameter shapes give the weights at a bit
width (mlx-lm's affine quantization: groups of 64 with an fp16 scale and bias), layer
types give what grows with the context (full attention), what stops at a window
(sliding attention) and what stays constant (recurrent layers such as Qwen3-Next's
linear attention); the planner's own model (planner.layers_footprint) does the rest."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from justfit.planning.cost_model import MIN_PREFILL_CHUNK, layers_footprint
from kvexec import FORMATS, KVConfig, get_format, ladder

GROUP = 64  # mlx-lm's default quantization group: an fp16 scale and bias per 64 weights


@dataclass(frozen=True)
class ConfigShape:
    """What a model's config.json says about its shapes: what its memory is computed from."""

    model_type: str
    kinds: tuple[str, ...]  # per layer: "full", "sliding" or "linear"
    window: int | None
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the MLP width one token uses (routed experts' and shared, for MoE)
    vocab: int
    context_limit: int
    embed_params: int
    head_params: int  # 0 when tied to the embedding
    layer_params: tuple[int, ...]  # quantizable (linear) weights per layer
    small_params: int  # norms, convolutions, gates: kept at 16 bits
    state_elems: tuple[int, int]  # per recurrent layer: (conv state elements, recurrent state elements)

    @property
    def params(self) -> int:
        """Parameters in all: embedding, head, layers and the small ones."""
        return self.embed_params + self.head_params + sum(self.layer_params) + self.small_params


def _text(config: dict) -> dict:
    """The language model's part (multimodal configs nest it as text_config)."""
    return {**config, **config.get("text_config", {})} if "text_config" in config else config


def layer_kinds(c: dict, layers: int) -> tuple[str, ...]:
    """Each layer's attention ("full", "sliding" or "linear") from a config's fields."""
    names = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
    if isinstance(c.get("layer_types"), list) and len(c["layer_types"]) == layers:
        return tuple(names.get(t, "full") for t in c["layer_types"])
    if c.get("full_attention_interval"):  # Qwen3-Next: every n-th layer full, the rest linear
        n = c["full_attention_interval"]
        return tuple("full" if (i + 1) % n == 0 else "linear" for i in range(layers))
    if c["model_type"].startswith("gemma3"):  # five sliding layers, then a global one
        n = c.get("sliding_window_pattern", 6)
        return tuple("full" if (i + 1) % n == 0 else "sliding" for i in range(layers))
    if c.get("sliding_window") and c.get("use_sliding_window", True) and c["model_type"] == "mistral":
        return ("sliding",) * layers
    return ("full",) * layers


def read_config(config: dict) -> ConfigShape:
    """The shapes that decide memory, from a config.json's fields (Gemma 3's defaults
    where its configs leave them out)."""
    c = _text(config)
    model_type = c.get("model_type", "")
    gemma = model_type.startswith("gemma3")
    try:
        hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    except KeyError as e:
        raise ValueError(f"config.json has no {e.args[0]!r}: not a transformer language model config") from None
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    vocab = c.get("vocab_size") or (262208 if gemma else 32000)
    kinds = layer_kinds({**c, "model_type": model_type}, layers)
    window = c.get("sliding_window") or (4096 if gemma else None)
    gated_q = 2 if model_type == "qwen3_next" else 1  # its attention gates the output per head
    attn = hidden * heads * head_dim * (gated_q + 1) + 2 * hidden * kv_heads * head_dim
    # Linear attention (gated delta net): q, k, v and the gate in, conv over q/k/v, out.
    nk, nv = c.get("linear_num_key_heads", 0), c.get("linear_num_value_heads", 0)
    key_dim, value_dim = nk * c.get("linear_key_head_dim", 0), nv * c.get("linear_value_head_dim", 0)
    conv_dim, kernel = 2 * key_dim + value_dim, c.get("linear_conv_kernel_dim", 4)
    linear = hidden * (2 * key_dim + 2 * value_dim) + hidden * 2 * nv + value_dim * hidden
    dense = 3 * hidden * c.get("intermediate_size", 4 * hidden)
    experts = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0
    moe_inter = c.get("moe_intermediate_size") or c.get("intermediate_size", 0)
    shared_inter = c.get("shared_expert_intermediate_size", 0)
    moe = experts * 3 * hidden * moe_inter + hidden * experts + 3 * hidden * shared_inter + hidden * bool(shared_inter)
    step, mlp_only = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
    params = []
    for i, kind in enumerate(kinds):
        sparse = experts and i not in mlp_only and (i + 1) % step == 0
        params.append((linear if kind == "linear" else attn) + (moe if sparse else dense))
    top_k = c.get("num_experts_per_tok", 0)
    intermediate = (top_k * moe_inter + shared_inter) if experts else c.get("intermediate_size", 4 * hidden)
    tied = c.get("tie_word_embeddings", gemma)
    small = layers * 4 * hidden + kinds.count("linear") * (conv_dim * kernel + 2 * nv)
    return ConfigShape(model_type, kinds, window, hidden, heads, kv_heads, head_dim, intermediate, vocab,
                       c.get("max_position_embeddings", 131072 if gemma else 4096), vocab * hidden,
                       0 if tied else vocab * hidden, tuple(params), small,
                       ((kernel - 1) * conv_dim, nv * c.get("linear_key_head_dim", 0) * c.get("linear_value_head_dim", 0)))


def quantized_bytes(params: int, bits: int) -> int:
    """Bytes of `params` weights at `bits` (16: unquantized half precision)."""
    return params * 2 if bits >= 16 else int(params * (bits / 8 + 4 / GROUP))


def _footprint(s: ConfigShape, positions: int, bits: int, kv: KVConfig | None, act_bytes: int,
               offloaded: bool = False, chunk: int = MIN_PREFILL_CHUNK, pressed: bool = False, disk_layers: int = 0):
    layers = [quantized_bytes(p, bits) for p in s.layer_params]
    outer = quantized_bytes(s.embed_params + s.head_params, bits) + s.small_params * 2
    conv, recurrent = s.state_elems
    return layers_footprint(
        positions, full_layers=s.kinds.count("full"), windows=(s.window,) * s.kinds.count("sliding"),
        state_bytes=s.kinds.count("linear") * (conv * act_bytes + recurrent * 4), heads=s.heads,
        kv_heads=s.kv_heads, head_dim=s.head_dim, hidden=s.hidden, intermediate=s.intermediate, vocab=s.vocab,
        weights=outer + (0 if offloaded else sum(layers)), working=max(layers) if offloaded else 0,
        chunk=chunk, kv=kv, act_bytes=act_bytes, pressed=pressed, limited=True,  # sized for a budget
        disk_layers=disk_layers)


def config_fit_report(config: dict, bits: int, budget: int, context: int | None = None,
                      kv: KVConfig | None = KVConfig(), act_bytes: int = 2) -> dict:
    """Weights at `bits`, KV bytes per position and the most positions that fit `budget`
    per KV format (resident, and with layers offloaded from disk), and the plan for
    `context` positions; `act_bytes` 2 for half-precision compute (Apple GPUs), 4 for
    fp32 (MLX's CPU backend)."""
    from justfit.planning.fit import llama_cpp_rows

    s = read_config(config)
    rows = []
    for name in [*FORMATS, *([None] if kv is None else [])]:  # None: planned with mlx-lm's own cache
        if name is not None and not get_format(name).supports_head_dim(s.head_dim):
            continue
        fkv = None if name is None else replace(kv or KVConfig(), format=name, layer_formats=())
        probe = _footprint(s, 1, bits, fkv, act_bytes)
        rows.append({"format": name or "mlx-lm",
                     "bytes_per_position": probe.shape.bytes_per_position,
                     "max_positions": probe.max_positions(budget),
                     "max_positions_offloaded": _footprint(s, 1, bits, fkv, act_bytes, True).max_positions(budget)})
    # Other programs' KV for the same model and budget (justfit.planning.fit.COMPARISON_NOTE):
    # mlx-lm at float16, and at float32 where the activations asked about are.
    for dtype, width in (("fp16", 2), ("fp32", 4))[:2 if act_bytes == 4 else 1]:
        probe = _footprint(s, 1, bits, None, width)
        rows.append({"format": f"mlx-lm {dtype}", "compare": True, "bytes_per_position": probe.shape.bytes_per_position,
                     "max_positions": probe.max_positions(budget), "max_positions_offloaded": None})
    weights = _footprint(s, 1, bits, None, act_bytes).weights
    rows += [{k: v for k, v in row.items() if k != "transient_bound"}  # this table has no transient column
             for row in llama_cpp_rows(s.kv_heads, s.head_dim, s.kinds.count("full"),
                                       (s.window,) * s.kinds.count("sliding"), weights, budget)]
    report = {"model_type": s.model_type, "params": s.params, "bits": bits, "budget": budget,
              "context_limit": s.context_limit, "act_bytes": act_bytes,
              "layers": {k: s.kinds.count(k) for k in ("full", "sliding", "linear")}, "window": s.window,
              "weights": _footprint(s, 1, bits, None, act_bytes).weights,
              "kv_format": kv.format if kv else "mlx-lm", "formats": rows}
    steps = [f.name for f in ladder(kv, s.head_dim)] if kv else []
    if len(steps) > 1:  # pages of the format in use stepping down under the budget, as the engine does
        report["pressure"] = {"ladder": steps, "max_positions": _footprint(s, 1, bits, kv, act_bytes,
                                                                           pressed=True).max_positions(budget)}
    if context is not None:
        fp = _footprint(s, context, bits, kv, act_bytes, chunk=512)
        if fp.total > budget and len(steps) > 1:
            fp = _footprint(s, context, bits, kv, act_bytes, pressed=True)
        offloaded = _footprint(s, context, bits, kv, act_bytes, True, MIN_PREFILL_CHUNK)
        report["plan"] = {"positions": context, "footprint": fp.as_dict(), "fits": fp.total <= budget,
                          "fits_offloaded": offloaded.total <= budget, "beyond_context": context > s.context_limit}
    return report


# The default pages' mix as calibration chose it on SmolLM2 (docs/BENCHMARKS.md, "The
# default pages": k5a128v5r64 x21, k6a128v5r64 x7, k6a128v6r64 x2, 5.558 bits a value).
# Allocated keys take the bytes of per-channel keys of their mean width, so the `c`
# formats of those widths stand in for them where no model was calibrated.
CALIBRATED_MIX = (("k5c128v5r64", 21), ("k6c128v5r64", 7), ("k6c128v6r64", 2))


def calibrated_standin(layers: int, base: KVConfig | None = None) -> KVConfig:
    """Per-layer formats for `layers` attention layers in CALIBRATED_MIX's proportions
    (largest remainders): the calibrated default's bytes, before a model is calibrated."""
    total = sum(n for _, n in CALIBRATED_MIX)
    shares = [(name, n * layers / total) for name, n in CALIBRATED_MIX]
    counts = {name: int(x) for name, x in shares}
    for name, x in sorted(shares, key=lambda t: t[1] - int(t[1]), reverse=True)[:layers - sum(counts.values())]:
        counts[name] += 1
    formats = tuple(name for name, _ in CALIBRATED_MIX for _ in range(counts[name]))
    return replace(base or KVConfig(), format=CALIBRATED_MIX[0][0], layer_formats=formats)


def config_disk_report(config: dict, bits: int, budget: int, folder: str, bandwidth, context: int | None = None,
                       kv: KVConfig | None = None, act_bytes: int = 2, limit: int | None = None) -> dict:
    """`justfit fit --config --kv-disk`: every full-attention layer's pages on disk
    (justfit.planning.disk_plan), the weights resident; `kv` None: the calibrated
    default's mix (`calibrated_standin`)."""
    from justfit.planning.disk_plan import OTHER_FORMATS, bits_per_value, disk_report

    s = read_config(config)
    full = s.kinds.count("full")
    if not full:
        raise ValueError("this model has no full-attention layer: no page grows with the context, none goes to disk")
    label = "the default pages' mix as calibrated on SmolLM2 (no model to calibrate)" if kv is None else kv.format
    kv = kv or calibrated_standin(full + s.kinds.count("sliding"))

    def probe(k: KVConfig) -> object:
        return _footprint(s, 1, bits, k, act_bytes, disk_layers=full)

    others = [(name, bits_per_value(k, s.kv_heads, s.head_dim), probe(k))
              for name, k in [("default pages", calibrated_standin(full + s.kinds.count("sliding"), kv)),
                              *((n, replace(kv, format=n, layer_formats=())) for n in OTHER_FORMATS)]
              if not k.layer_formats or get_format(k.layer_formats[0]).supports_head_dim(s.head_dim)
              if get_format(k.format).supports_head_dim(s.head_dim)]
    plan = None
    if context is not None:
        plan = _footprint(s, context, bits, kv, act_bytes, chunk=512, disk_layers=full)
        if plan.total > budget:
            plan = _footprint(s, context, bits, kv, act_bytes, disk_layers=full)
    report = disk_report(probe(kv), budget, folder, bandwidth, bits_per_value(kv, s.kv_heads, s.head_dim), label,
                         plan, limit, others)
    report["context_limit"] = s.context_limit
    return report


def load_config(path: str | Path) -> dict:
    """A config.json (or the folder holding one), with a clear error for anything else."""
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        config = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {p} as a config.json: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{p} is not a JSON object")
    return config


def format_config_fit(r: dict) -> str:
    """The report as the terminal shows it."""
    from justfit.planning.fit import COMPARISON_NOTE, format_rows, label_width
    from justfit.memory import format_size

    layers = ", ".join(f"{n} {k}" for k, n in r["layers"].items() if n)
    window = f" (window {r['window']:,})" if r["layers"]["sliding"] else ""
    lines = [f"{r['model_type']} from config.json · {r['params'] / 1e9:.2f}B parameters · {layers} layers{window} "
             f"· trained context {r['context_limit']:,}",
             f"weights at {r['bits']} bits: {format_size(r['weights'])} · budget {format_size(r['budget'])} · "
             f"activations {'fp32' if r['act_bytes'] == 4 else 'fp16'}", "",
             f"{'KV format':<{label_width(r)}} {'bytes/pos':>10} {'max positions':>14} {'offloaded layers':>17}"]
    lines += format_rows(r, "(* the format in use; bytes/pos summed over attention layers, as `justfit fit` does; "
                            "sliding layers stop at their window and recurrent layers hold a constant state, both "
                            f"counted in max positions; positions past the trained context {r['context_limit']:,} "
                            f"need a model that extrapolates. {COMPARISON_NOTE})")
    plan = r.get("plan")
    if plan:
        fp = plan["footprint"]
        verdict = ("fits" if plan["fits"] else "fits only with layers offloaded to disk" if plan["fits_offloaded"]
                   else "does NOT fit")
        beyond = f"; past the trained context {r['context_limit']:,}" if plan["beyond_context"] else ""
        lines += ["", f"plan for {plan['positions']:,} positions: {verdict} ({format_size(fp['total'])} of "
                  f"{format_size(r['budget'])}{beyond})",
                  f"  weights {format_size(fp['weights'])} + KV {format_size(fp['kv'])} + transient "
                  f"{format_size(fp['transient'])} + reserve {format_size(fp['reserve'])} ({fp['reserve_from']})"]
    return "\n".join(lines)
