"""Constrained decoding: a reply that follows a grammar (justfit.config.OutputConstraint:
a JSON schema, any JSON object, a regex, a Lark or GBNF grammar), through llguidance.

Three parts:

- The grammar tokenizer (`llguidance.LLTokenizer`), built once per engine on the first
  constrained request from each token's bytes (JustFit's own GGUF vocabularies,
  justfit.model.vocabulary) or from the `tokenizers` library's JSON (a Hugging Face
  folder), with the model's end tokens (its EOS and the end-of-turn token a chat reply
  ends with) as the only tokens allowed once the grammar is satisfied. Control tokens
  are marked special: never allowed inside constrained text.
- `Grammars` (`engine.grammars`): `check` compiles a constraint, in a worker thread
  the caller stops waiting for after `COMPILE_LIMIT_S`, and raises GrammarError naming
  what failed (llguidance refuses JSON-schema keywords it does not enforce); compiled
  grammars are kept by the hash of their kind and text in a cache bounded in bytes
  (EngineConfig.grammar_cache_bytes, which a whole-process budget counts from load:
  justfit.planning.budget.ProcessShare). `matcher` hands a sequence its own matcher.
- `Constrained`: one sequence's matcher, with the masks, forced tokens and draft
  checks the decoder (justfit.engine.decoder) asks of it.

A compile the caller stopped waiting for runs on in its thread until it ends: each of
llguidance's steps is bounded by its fuel limits (LLParserLimits: the lexer's fuel, the
grammar's size, the lexer's states), so an abandoned compile ends on its own; at most
`COMPILE_THREADS` run at once, and a constraint that timed out is remembered as refused.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from justfit.config import OutputConstraint
from justfit.errors import GrammarError

COMPILE_LIMIT_S = 2.0  # a compile that takes longer is refused (the caller stops waiting)
COMPILE_THREADS = 2  # compiles running at once (an abandoned one keeps its thread until it ends)
# Bytes a compiled grammar holds per byte of its llguidance grammar text (its lexer and
# parser tables), the cache's estimate of an entry: measured (docs/SERVING.md).
BYTES_PER_GRAMMAR_BYTE = 200
ENTRY_FLOOR_BYTES = 64 * 1024  # the least an entry is counted: a matcher's own tables
# The grammar tokenizer's resident bytes per vocabulary entry (its token trie and
# slices, and the token bytes it keeps): measured (docs/SERVING.md).
TOKENIZER_BYTES_PER_ENTRY = 480
# Tokens a chat reply ends with besides the tokenizer's EOS, where the vocabulary has them.
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")
# JSON as compact text: "," and ":" with no whitespace around them, so a constrained
# reply never runs on in spaces or newlines; overrides a schema's own "x-guidance".
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}


def _llguidance():
    """The llguidance module (imported on the first constrained request: no import-time cost)."""
    import llguidance

    return llguidance


def grammar_text(constraint: OutputConstraint) -> str:
    """llguidance's grammar for `constraint` (not yet compiled); GrammarError when its
    text cannot be read at all (a schema that is not JSON, a GBNF grammar that does not
    convert)."""
    llg = _llguidance()
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_OPTIONS, JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, dict):
                raise GrammarError(kind, "a JSON schema must be a JSON object")
            return llg.LLMatcher.grammar_from_json_schema(closed_objects(schema), JSON_OPTIONS, JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "lark":
            return llg.LLMatcher.grammar_from_lark(text)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError(kind, "nested too deeply") from None
    except Exception as e:  # the schema's JSON, serde's recursion limit, GBNF's conversion
        raise GrammarError(kind, str(e)) from None


# Keywords whose values are subschemas, one or a list or a name -> schema map each
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMAS = ("prefixItems", "anyOf", "oneOf")
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """A copy of `schema` in which an object that lists its `properties` and says
    nothing of others (`additionalProperties`, `patternProperties`,
    `unevaluatedProperties`) allows no others, as llama.cpp's and xgrammar's converters
    and OpenAI's strict mode read it: a model may otherwise add keys until its token
    limit. allOf's members stay open (closed, they would forbid each other's keys)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _NAMED_SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_open_member(s) for s in out["allOf"]]
    if (isinstance(out.get("properties"), dict) and not
            {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out)):
        out["additionalProperties"] = False
    return out


def _open_member(schema):
    """An allOf member: its subschemas closed, itself left open."""
    if not isinstance(schema, dict):
        return schema
    closed = closed_objects(schema)
    if "additionalProperties" not in schema:
        closed.pop("additionalProperties", None)
    return closed


def constraint_key(constraint: OutputConstraint) -> str:
    """The compile cache's key: a hash of the constraint's kind and text."""
    return hashlib.sha256(f"{constraint.kind}\0{constraint.text}".encode()).hexdigest()


def end_tokens(tokenizer) -> list[int]:
    """The tokens a constrained reply may end with: the tokenizer's EOS, and the
    end-of-turn tokens (END_OF_TURN) its vocabulary has."""
    ends = set(int(t) for t in tokenizer.eos_token_ids)
    vocab = _vocabulary(tokenizer)
    find = getattr(vocab, "token_to_id", None)
    if find is None:  # a Hugging Face tokenizer (mlx-lm's wrapper)
        hf = getattr(tokenizer, "_tokenizer", None)
        find = getattr(hf, "convert_tokens_to_ids", None)
        unk = getattr(hf, "unk_token_id", None)
    else:
        unk = None
    for name in END_OF_TURN if find is not None else ():
        token = find(name)
        if isinstance(token, int) and token >= 0 and token != unk:
            ends.add(token)
    return sorted(ends)


def _vocabulary(tokenizer):
    """A GGUF tokenizer's vocabulary (justfit.model.tokenizer.GGUFTokenizer.pieces), or None."""
    return getattr(tokenizer, "pieces", None)


def _hf_json(tokenizer) -> str | None:
    """The `tokenizers` library's JSON of a tokenizer that has one, else None."""
    vocab = _vocabulary(tokenizer)
    if vocab is not None and hasattr(vocab, "to_json"):
        return vocab.to_json()
    hf = getattr(tokenizer, "_tokenizer", None)  # mlx-lm's TokenizerWrapper around transformers'
    backend = getattr(hf, "backend_tokenizer", None)
    return backend.to_str() if backend is not None else None


class _Pieces:
    """What llguidance's TokenizerWrapper reads from a GGUF vocabulary: each token's
    bytes, the special ones, and an encode function (text in the middle of a reply)."""

    def __init__(self, vocab, eos: int, bos: int | None):
        self.tokens = [vocab.piece_bytes(i) for i in range(len(vocab))]
        self.special_token_ids = [i for i in range(len(vocab)) if vocab.is_control(i)]
        self.eos_token_id, self.bos_token_id = eos, bos
        self._encode = vocab.encode_fragment

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


def build_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer for a JustFit tokenizer, `vocab_size` wide (the logits'
    width: the model's embedding may be padded past the vocabulary)."""
    llg = _llguidance()
    ends = end_tokens(tokenizer)
    vocab = _vocabulary(tokenizer)
    if vocab is not None and hasattr(vocab, "piece_bytes"):
        wrapper = llg.TokenizerWrapper(_Pieces(vocab, ends[0], getattr(tokenizer, "bos_token_id", None)))
        built = llg.LLTokenizer(wrapper, n_vocab=max(vocab_size, len(vocab)), eos_token=ends)
        wrapper.tokens = []  # llguidance copied them; the wrapper stays for its encode function
        return built
    text = _hf_json(tokenizer)
    if text is None:
        raise GrammarError("constraint", "this model's tokenizer cannot be used for constrained output")
    return llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=ends)


def tokenizer_bytes(vocab_size: int) -> int:
    """The grammar tokenizer's resident bytes for a vocabulary of `vocab_size` (the
    planner counts them with the cache's bound before the tokenizer exists)."""
    return TOKENIZER_BYTES_PER_ENTRY * vocab_size


@dataclass
class _Entry:
    """A cached compile: the matcher each sequence's copy starts from, or the refusal."""

    matcher: object | None
    error: GrammarError | None
    nbytes: int


class Grammars:
    """An engine's compiled grammars (see the module doc): `check` a constraint before
    any work, `matcher` for a sequence. Safe to call from any thread."""

    def __init__(self, tokenizer, vocab_size: int, cache_bytes: int, limit_s: float = COMPILE_LIMIT_S):
        self.source, self.vocab_size = tokenizer, vocab_size
        self.cache_bytes, self.limit_s = cache_bytes, limit_s
        self._lock = threading.Lock()  # guards the cache and the tokenizer's build
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self.cached_bytes = 0  # the cache's estimated bytes now
        self._tokenizer = None
        self._ends: frozenset[int] = frozenset()
        self._slots = threading.BoundedSemaphore(COMPILE_THREADS)
        self.compiles = self.timeouts = 0

    @property
    def bound_bytes(self) -> int:
        """The most constrained decoding holds: the cache's bound and the grammar
        tokenizer's predicted bytes (`justfit fit` counts it for a server that will use it)."""
        return self.cache_bytes + tokenizer_bytes(self.vocab_size)

    @property
    def in_use(self) -> bool:
        """Whether a constrained request came (the grammar tokenizer is built)."""
        return self._tokenizer is not None

    @property
    def room_bytes(self) -> int:
        """What a whole-process budget sets aside for the cache to grow into: its unfilled
        bound once constrained output is in use (the tokenizer, built, is measured as the
        process's own), nothing before."""
        return max(0, self.cache_bytes - self.cached_bytes) if self.in_use else 0

    @property
    def resident_bytes(self) -> int:
        """The estimated bytes held now: the tokenizer once built, and the cache."""
        return (tokenizer_bytes(self.vocab_size) if self._tokenizer is not None else 0) + self.cached_bytes

    @property
    def tokenizer(self):
        """llguidance's tokenizer, built on first use and never rebuilt."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = build_tokenizer(self.source, self.vocab_size)
                self._ends = frozenset(self._tokenizer.eos_tokens)
            return self._tokenizer

    def check(self, constraint: OutputConstraint) -> None:
        """Compile `constraint` (or find it compiled); GrammarError when it cannot be, or
        not within the time limit."""
        self._entry(constraint)

    def matcher(self, constraint: OutputConstraint) -> Constrained:
        """A fresh matcher for one sequence's reply (compiling, as `check`, if needed)."""
        entry = self._entry(constraint)
        return Constrained(entry.matcher.deep_copy(), self.vocab_size, self._ends)

    def _entry(self, constraint: OutputConstraint) -> _Entry:
        """The cached compile of `constraint`, compiled now when missing; raises its refusal."""
        key = constraint_key(constraint)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if entry is None:
            entry = self._compile_within_limit(constraint)
            self._keep(key, entry)
        if entry.error is not None:
            raise entry.error
        return entry

    def _keep(self, key: str, entry: _Entry) -> None:
        """Cache `entry`, the least recently used ones leaving past the bound (one larger
        than the whole bound is not kept)."""
        if entry.nbytes > self.cache_bytes:
            return
        with self._lock:
            old = self._cache.pop(key, None)
            self.cached_bytes -= old.nbytes if old is not None else 0
            self._cache[key] = entry
            self.cached_bytes += entry.nbytes
            while self.cached_bytes > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self.cached_bytes -= dropped.nbytes

    def _compile_within_limit(self, constraint: OutputConstraint) -> _Entry:
        """Compile in a worker thread, waiting at most `limit_s` (a free compile slot
        included); a compile past it is refused, and its thread left to end on its own."""
        tokenizer = self.tokenizer  # built outside the limit: the engine's cost, once
        box: dict = {}
        finished = threading.Event()

        def work() -> None:
            try:
                box["entry"] = compile_entry(tokenizer, constraint)
            except BaseException as e:  # handed to the waiting caller
                box["error"] = e
            finally:
                finished.set()
                self._slots.release()

        if not self._slots.acquire(timeout=self.limit_s):
            raise GrammarError(constraint.kind, f"other grammars are still compiling after {self.limit_s:g} s; "
                                                f"retry")
        self.compiles += 1
        # Not a daemon: the interpreter waits for an abandoned compile at exit (bounded by
        # llguidance's fuel) rather than finalizing under native code that calls back into it.
        threading.Thread(target=work, name="justfit-grammar-compile", daemon=False).start()
        if not finished.wait(self.limit_s):
            self.timeouts += 1
            return _Entry(None, GrammarError(constraint.kind, f"too complex: not compiled within {self.limit_s:g} s"),
                          ENTRY_FLOOR_BYTES // 64)
        if "error" in box:
            error = box["error"]
            if isinstance(error, GrammarError):
                return _Entry(None, error, len(str(error)) + 256)
            raise error
        return box["entry"]


def compile_entry(tokenizer, constraint: OutputConstraint) -> _Entry:
    """Compile `constraint` against `tokenizer` within llguidance's default limits: the
    matcher, its estimated bytes, or the refusal naming what failed."""
    llg = _llguidance()
    try:
        grammar = grammar_text(constraint)
    except GrammarError as e:
        return _Entry(None, e, len(str(e)) + 256)
    matcher = llg.LLMatcher(tokenizer, grammar, limits=llg.LLParserLimits(verbose_errors=False), log_level=0)
    if not matcher.is_error():  # a grammar can compile and still match nothing (`root ::= root`):
        first = matcher.deep_copy()  # its first mask is an error, refused here rather than mid-reply
        first.compute_bitmask()
        if first.is_error():
            error = GrammarError(constraint.kind, "the grammar matches no text at all")
            return _Entry(None, error, len(str(error)) + 256)
    if matcher.is_error():
        error = GrammarError(constraint.kind, matcher.get_error())
        return _Entry(None, error, len(str(error)) + 256)
    return _Entry(matcher, None, max(ENTRY_FLOOR_BYTES, BYTES_PER_GRAMMAR_BYTE * len(grammar)))


@dataclass
class RowMasks:
    """The masks of a verify step's rows after drafted tokens, and the tokens the
    grammar forces after the whole draft."""

    bias: np.ndarray  # [rows, vocab]: 0 where allowed, -inf elsewhere
    forced_after: list[int]


class Constrained:
    """One sequence's grammar state (an llguidance matcher): which tokens may come next,
    which are forced, whether it ended. The matcher has taken every token decided so far."""

    def __init__(self, matcher, vocab_size: int, ends: frozenset[int]):
        self.matcher, self.vocab_size, self.ends = matcher, vocab_size, ends
        self._bits = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    @property
    def done(self) -> bool:
        """The grammar is satisfied and takes nothing more (the reply ends)."""
        return self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, as a bool per vocabulary entry."""
        return self._bits_now().view(bool)

    def _bits_now(self) -> np.ndarray:
        """The tokens allowed next, as a 0/1 byte per vocabulary entry."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._raise_if_error()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size]

    def bias(self) -> np.ndarray:
        """What to add to the logits: 0 where a token is allowed next, -inf elsewhere."""
        with np.errstate(divide="ignore"):  # log(1) = 0, log(0) = -inf: faster than a select
            return np.log(self._bits_now().astype(np.float32))

    def mask(self, logits: mx.array) -> mx.array:
        """`logits` ([vocab]) with the tokens the grammar does not allow next at -inf."""
        return apply_mask(logits, self.bias())

    def consume(self, token: int) -> None:
        """Take the decided `token` (one the mask allowed)."""
        if not self.matcher.consume_token(token):
            self._raise_if_error()
            raise RuntimeError(f"the grammar refused token {token}")

    def forced(self) -> list[int]:
        """The tokens the grammar forces next ([] where it leaves a choice, or once done)."""
        return [] if self.done else list(self.matcher.compute_ff_tokens())

    def guessable(self, tokens: list[int]) -> int:
        """How many of drafted `tokens` a verify may check: the grammar allows them, and
        none stands where the grammar forces a token (that one is taken, not guessed)."""
        n = 0
        for token in tokens:
            if self.forced() or self.matcher.validate_tokens([token]) < 1:
                break
            self.consume(token)
            n += 1
        self.matcher.rollback(n)
        return n

    def row_masks(self, tokens: list[int]) -> RowMasks:
        """The masks (as biases) after each prefix of drafted `tokens` (rows 0 .. len),
        each taken with the prefix consumed then rolled back; and what is forced after them all."""
        rows = [self.bias()]
        for token in tokens:
            self.consume(token)
            rows.append(self.bias())
        forced = self.forced()
        self.matcher.rollback(len(tokens))
        return RowMasks(np.stack(rows), forced)

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.matcher.get_error()}")


def apply_mask(logits: mx.array, bias: np.ndarray) -> mx.array:
    """`logits` ([..., vocab]) plus a grammar's `bias` (0 where allowed, -inf elsewhere;
    [..., vocab], broadcast); a narrower bias masks the logits' extra columns too."""
    width = logits.shape[-1]
    if bias.shape[-1] != width:
        fitted = np.full(bias.shape[:-1] + (width,), -np.inf, dtype=np.float32)
        n = min(width, bias.shape[-1])
        fitted[..., :n] = bias[..., :n]
        bias = fitted
    return logits + mx.array(bias).astype(logits.dtype)
