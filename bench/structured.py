"""What constrained decoding costs, and what forced tokens save: SmolLM2 and Gemma 3,
greedy, drafts off (each request's `speculate` false: the same work per step), in one
process per model.

    python -m bench.structured --rounds 7

Each round, in alternating order:

- mask cost: a JSON-schema reply (a list of records: mostly sampled tokens) with forced
  tokens off, so every token costs one step with its mask computed and applied, against
  an unconstrained reply of exactly as many tokens (`ignore_eos`, the same prompt).
  Figure: decode tokens a second of each; target: constrained at most 5% slower.
- forced tokens: a schema whose keys are long and fixed and whose values are mostly
  enums and booleans, decoded with forced tokens on (the grammar's forced tokens go
  into the next step's forward, no step of their own) and off (one a step: the same
  reply). Figure: the reply's decode time off / on; target >= 1.3x.

Reports each figure's median over the rounds and the ratio of the medians."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MODELS = ("smollm2", "gemma3")
RECORDS = {  # mostly sampled: free strings and numbers, short keys
    "type": "object", "required": ["people"], "additionalProperties": False,
    "properties": {"people": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "required": ["name", "city", "age", "note"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 30},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "note": {"type": "string", "maxLength": 60}}}}}}
RECORDS_PROMPT = "List eight people with their name, city, age and a short note about each, as JSON."
_FIXED_KEYS = ["customer_account_identifier", "preferred_contact_channel", "subscription_tier_level",
               "marketing_emails_opted_in", "two_factor_authentication_enabled", "billing_address_verified",
               "account_region_of_residence", "default_display_language", "accessibility_high_contrast_mode",
               "newsletter_frequency_preference"]
FIXED = {  # mostly forced: long fixed keys, in order; enum and boolean values
    "type": "object", "additionalProperties": False, "required": _FIXED_KEYS,
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 1, "maximum": 999999},
        "preferred_contact_channel": {"enum": ["electronic_mail_message", "telephone_voice_call"]},
        "subscription_tier_level": {"enum": ["complimentary_basic_plan", "professional_premium_plan"]},
        "marketing_emails_opted_in": {"type": "boolean"},
        "two_factor_authentication_enabled": {"type": "boolean"},
        "billing_address_verified": {"type": "boolean"},
        "account_region_of_residence": {"enum": ["european_economic_area", "north_american_region"]},
        "default_display_language": {"enum": ["british_english_language", "continental_french_language"]},
        "accessibility_high_contrast_mode": {"type": "boolean"},
        "newsletter_frequency_preference": {"enum": ["weekly_digest_summary", "monthly_digest_summary"]}}}
FIXED_PROMPT = "Write the account settings of a new customer as JSON."


def _prompt(engine, text: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def _reply(engine, tokens: list[int], sp) -> dict:
    start = time.perf_counter()
    r = engine.reply(tokens, sp)
    st = r.stats
    return {"text": r.text, "tokens": st.generated_tokens, "forced": st.forced_tokens, "decode_s": st.decode_s,
            "decode_tps": st.decode_tps, "wall_s": time.perf_counter() - start, "finish": st.finish_reason}


def one_round(engine, order: int, length: int, max_tokens: int = 600) -> dict:
    """One round's four replies, in `order` (0 or 1: which of each pair goes first);
    the unconstrained reply is `length` tokens (the constrained one's, greedy)."""
    from justfit import SamplingParams
    from justfit.config import OutputConstraint

    records = OutputConstraint("json_schema", json.dumps(RECORDS))
    fixed = OutputConstraint("json_schema", json.dumps(FIXED))
    rec_prompt, fixed_prompt = _prompt(engine, RECORDS_PROMPT), _prompt(engine, FIXED_PROMPT)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, speculate=False)
    sends = {"constrained": (rec_prompt, _with(greedy, constraint=records, force_tokens=False)),
             "free": (rec_prompt, _with(greedy, max_tokens=length, ignore_eos=True)),
             "forced_on": (fixed_prompt, _with(greedy, constraint=fixed, force_tokens=True)),
             "forced_off": (fixed_prompt, _with(greedy, constraint=fixed, force_tokens=False))}
    pairs = (("constrained", "free"), ("forced_on", "forced_off"))
    names = [name for pair in pairs for name in (pair if order == 0 else pair[::-1])]
    return {name: _reply(engine, *sends[name]) for name in names}


def _with(sp, **changes):
    from dataclasses import replace

    return replace(sp, **changes)


def worker(model: str, rounds: int, max_tokens: int = 600) -> dict:
    """Every round on `model`, in this process: each figure per round."""
    from justfit import Engine
    from justfit.config import EngineConfig

    # Drafts off per request (speculate=False), not per engine: with --draft none the plan
    # gives a decode step one row, and forced tokens would go one a step either way
    engine = Engine(model, config=EngineConfig())
    warm = one_round(engine, 0, 1, max_tokens)  # compiles the grammars and MLX's kernels; not counted
    runs = [one_round(engine, i % 2, warm["constrained"]["tokens"], max_tokens) for i in range(rounds)]
    checks = {"constrained_ended": all(r["constrained"]["finish"] == "stop" for r in runs),
              "same_length": all(r["free"]["tokens"] == r["constrained"]["tokens"] for r in runs),
              "forced_same_reply": all(r["forced_on"]["text"] == r["forced_off"]["text"] for r in runs),
              "fixed_valid": _valid(FIXED, runs[-1]["forced_on"]["text"]),
              "records_valid": _valid(RECORDS, runs[-1]["constrained"]["text"])}
    return {"model": model, "rounds": rounds, "checks": checks, "runs": [
        {k: {f: v[f] for f in ("tokens", "forced", "decode_s", "decode_tps", "wall_s")} for k, v in r.items()}
        for r in runs], "texts": {"records": runs[-1]["constrained"]["text"], "fixed": runs[-1]["forced_on"]["text"]}}


def _valid(schema: dict, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return set(value) == set(schema["required"])


def summary(got: dict) -> dict:
    """Medians over the rounds and their ratios."""
    med = lambda kind, f: statistics.median(r[kind][f] for r in got["runs"])  # noqa: E731
    free, constrained = med("free", "decode_tps"), med("constrained", "decode_tps")
    on, off = med("forced_on", "decode_s"), med("forced_off", "decode_s")
    return {"model": got["model"], "rounds": got["rounds"], "tokens": got["runs"][0]["constrained"]["tokens"],
            "free_tps": round(free, 2), "constrained_tps": round(constrained, 2),
            "constrained_slowdown": round(free / constrained - 1, 4),
            "fixed_tokens": got["runs"][0]["forced_on"]["tokens"], "fixed_forced": got["runs"][0]["forced_on"]["forced"],
            "forced_on_s": round(on, 3), "forced_off_s": round(off, 3), "forced_speedup": round(off / on, 3),
            **got["checks"]}


def table(rows: list[dict]) -> str:
    """The summaries as a markdown table."""
    from bench.common import markdown_table

    head = ("| model | reply tokens | free tok/s | constrained tok/s | slower by | fixed-key reply: tokens (forced) "
            "| forced on s | forced off s | speed-up |\n|---|---|---|---|---|---|---|---|---|")
    return markdown_table(head, rows, lambda r: [
        r["model"], str(r["tokens"]), f"{r['free_tps']:.1f}", f"{r['constrained_tps']:.1f}",
        f"{r['constrained_slowdown']:+.1%}", f"{r['fixed_tokens']} ({r['fixed_forced']})", f"{r['forced_on_s']:.2f}",
        f"{r['forced_off_s']:.2f}", f"{r['forced_speedup']:.2f}x"], ("model",))


def main(argv: list[str] | None = None) -> dict:
    """Run each model in its own process; save and print the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    if args.worker:
        result = worker(args.worker, args.rounds)
        print(json.dumps(result))
        return result
    from bench.common import machine_info, run_worker, save

    rows, raw = [], []
    for model in args.models.split(","):
        got = run_worker("bench.structured", [model, "--rounds", str(args.rounds)], args.timeout)
        raw.append({"model": model, **got})
        rows.append({"model": model, **got} if "error" in got else summary(got))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    result = {"machine": machine_info(), "settings": {"rounds": args.rounds, "models": args.models, "speculate": False,
                                                      "temperature": 0}, "systems": rows, "raw": raw}
    path = save("structured", result)
    print(table(rows))
    print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
