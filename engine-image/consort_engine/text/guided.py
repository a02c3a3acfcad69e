"""Structured output: grammars compiled once (xgrammar), one matcher per guided sequence, and the
batch's token mask applied as one tensor op.

xgrammar was picked over llguidance on measured per-token mask cost (docs/structured-output.md).
The flow: the server compiles a request's GuidedSpec (cached by kind + spec; a spec that does not
compile is a typed 400) and gives each sequence its own GrammarMatcher. Every sampling step the
sampler fills one int32 bitmask [rows, ceil(V/32)] (all ones for unguided rows), unpacks it on the
logits' device and sets disallowed logits to -inf. The engine advances each matcher with the token
the sequence accepted; the grammar's stop tokens are the model's EOS ids, so EOS is allowed only
where the grammar may end, and a terminated matcher finishes the sequence ("stop").

Guided sequences speculate (n-gram drafts), as in vLLM: SpecDecoder.propose walks the
matcher over the draft and cuts it at the first token the grammar refuses (grammar_prefix, then
matcher.rollback); at verify the window's K+1 rows each get their own bitmask row (fill_window:
fill, accept the draft token, fill the next row, ..., roll back), so the argmax at every row is
grammar-legal (sampled requests: typical acceptance over those masked rows, and the token drawn at
the first refusal comes from its own row's mask, Sampler.sample(masked=True)); after verification the matcher advances over the emitted tokens only.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

CACHE_SIZE = 256
_BITS = 32


@dataclass(frozen=True)
class GuidedSpec:
    """What the output must match. kind: json_object | json_schema | regex | choice | grammar;
    spec: canonical text (schema JSON with sorted keys, regex, JSON list of choices, EBNF);
    param: the request field it came from, named in errors."""
    kind: str
    spec: str
    param: str


class GrammarError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class CompileBusy(Exception):
    """Every compile slot stayed taken for the whole wait."""


class CompileTimeout(Exception):
    """The compile did not finish in time (it goes on in the background)."""


T_ = TypeVar("T_")


class CompileSlots:
    """At most `slots` grammar compiles at once, each on a worker thread of the default pool, and a
    request waits at most `timeout_s` for its slot and its compile together. Unbounded, a burst of large
    new schemas took every worker thread (which also parse big bodies) and every core.

    xgrammar's compile cannot be interrupted: one past the deadline finishes in the background, still
    holding its slot, and its grammar is cached (an identical request later finds it). So slow compiles
    can delay other new grammars by at most their own run time; cached grammars never wait."""

    def __init__(self, slots: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._free = asyncio.Semaphore(slots)

    async def run(self, fn: Callable[[], T_]) -> T_:
        """fn() on a worker thread; CompileBusy or CompileTimeout past the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            await asyncio.wait_for(self._free.acquire(), self.timeout_s)
        except TimeoutError:
            raise CompileBusy() from None
        fut = loop.run_in_executor(None, fn)
        fut.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise CompileTimeout() from None

    def _release(self, fut: asyncio.Future) -> None:
        self._free.release()
        if not fut.cancelled():
            fut.exception()     # seen: a compile that failed after its request gave up is not an "unretrieved" error


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.8 writes length-bounded strings (maxLength/minLength) with a class that lets raw
# control characters through, which strict JSON parsers (Python's json.loads) refuse; unbounded
# strings already exclude them. And both classes accept UTF-8-encoded surrogates (ED A0-BF xx), which
# are not UTF-8: the output decodes them as three U+FFFD, so a string the grammar counted as 12
# characters came out as 14 and broke its maxLength. Every string character class excludes both.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_XGRAMMAR_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def schema_ebnf(xgr: Any, schema: str) -> str:
    """EBNF for a JSON schema: compact JSON (no free whitespace, or a weak model pads with spaces
    until max_tokens), properties in the schema's order, strings of well-formed UTF-8 without raw
    control characters."""
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return text.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR).replace(_XGRAMMAR_STRING_CHAR, _STRICT_STRING_CHAR)


class Grammars:
    """Compiler for one tokenizer + vocabulary, with an LRU cache of compiled grammars."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        fast = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, g: GuidedSpec) -> bool:
        with self._lock:
            return (g.kind, g.spec) in self._cache

    def compile(self, g: GuidedSpec) -> Any:
        key = (g.kind, g.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(g)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, g: GuidedSpec) -> Any:
        c = self._compiler
        try:
            if g.kind == "json_object":     # OpenAI's JSON mode: an object (the builtin grammar allows arrays)
                return c.compile_grammar(schema_ebnf(self._xgr, '{"type": "object"}'))
            if g.kind == "json_schema":
                return c.compile_grammar(schema_ebnf(self._xgr, g.spec))
            if g.kind == "regex":
                return c.compile_regex(g.spec)
            if g.kind == "choice":
                return c.compile_grammar(choice_ebnf(json.loads(g.spec)))
            if g.kind == "grammar":
                return c.compile_grammar(g.spec)
        except Exception as e:   # xgrammar raises RuntimeError/ValueError with the parser's message
            raise GrammarError(g.param, f"'{g.param}' does not compile: {str(e).strip().splitlines()[0][:300]}") from e
        raise GrammarError(g.param, f"unknown structured output kind {g.kind!r}")

    def matcher(self, g: GuidedSpec) -> Any:
        return self._xgr.GrammarMatcher(self.compile(g))


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 bitmask -> [rows, vocab] bool (bit j of word w = token 32w + j)."""
    shifts = torch.arange(_BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def grammar_prefix(matcher: Any, draft: list[int]) -> int:
    """How many leading draft tokens the grammar accepts; the matcher walks them and rolls back,
    so it ends where it began (drafts are checked before verify, the matcher advances on commit)."""
    n = 0
    if not matcher.is_terminated():
        for t in draft:
            if not matcher.accept_token(t):
                break
            n += 1
            if matcher.is_terminated():
                break
    if n:
        matcher.rollback(n)
    return n


def fill_window(matcher: Any, draft: list[int], bitmask: torch.Tensor, row: int) -> None:
    """One bitmask row per verify position (rows row .. row + len(draft)): the tokens the grammar
    allows before each draft token and after the last. The draft passed grammar_prefix, so the
    walk succeeds; rows past a terminated grammar stay all-ones (they are never read)."""
    n = 0
    for t in [*draft, None]:
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, row + n)
        if t is None or not matcher.accept_token(t):
            break
        n += 1
    if n:
        matcher.rollback(n)


def apply_mask(logits: torch.Tensor, matchers: list[Any],
               windows: list[tuple[int, Any, list[int]]] = ()) -> torch.Tensor:
    """Logits with each guided row's disallowed tokens at -inf (None matcher: row untouched).
    matchers: one per row from row 0; windows: (first row, matcher, draft) of a speculative verify
    window, len(draft) + 1 rows. One bitmask for the batch, filled on the CPU by the matchers, one
    masked_fill on the device."""
    rows, vocab = logits.shape
    words = (vocab + _BITS - 1) // _BITS
    bitmask = torch.full((rows, words), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None and not m.is_terminated():
            m.fill_next_token_bitmask(bitmask, i)
    for row, m, draft in windows:
        fill_window(m, draft, bitmask, row)
    allowed = _unpack(bitmask.to(logits.device, non_blocking=True), vocab)
    return logits.masked_fill(~allowed, -float("inf"))


def advance(matchers: list[Any], tokens: list[int]) -> None:
    """Feed each guided sequence its accepted token. A token the mask allowed is always accepted;
    a refusal would mean the mask and matcher disagree, which is a bug worth failing loudly on."""
    for m, t in zip(matchers, tokens):
        if m is not None and not m.is_terminated() and not m.accept_token(t):
            raise RuntimeError(f"grammar matcher refused token {t} that its own mask allowed")
