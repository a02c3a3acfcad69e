"""Text side of the engine: tokenizer.json + tokenizer_config.json, chat template, incremental detokenizer.

No transformers import: the `tokenizers` library and jinja2 (the same sandboxed environment transformers
uses for `apply_chat_template`; consort_common/chat_template.py, which routers render with too) keep
start-up fast.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from consort_common.chat_template import ChatTemplate, ChatTemplateError, load_chat_template, special_tokens


@dataclass
class Tokenizer:
    """The checkpoint's tokenizer with the special tokens and chat template from tokenizer_config.json."""

    hf: HFTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)   # bos_token/eos_token/unk_token/pad_token
    add_bos_token: bool = False
    chat_template: str | None = None
    _compiled: ChatTemplate | None = field(default=None, repr=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():   # the tokenizers library's own error names no path
            raise FileNotFoundError(f"{path}: no such file (the engine reads the checkpoint's tokenizer.json)")
        hf = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        special = special_tokens(cfg)
        return cls(hf=hf, bos_token=special.get("bos_token"), eos_token=special.get("eos_token"),
                   special_tokens=special, add_bos_token=bool(cfg.get("add_bos_token", False)),
                   chat_template=load_chat_template(model_dir, cfg))

    # ---- ids ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of text. With `limit`, more than `limit` tokens raise TooManyTokens before the
        ids become a Python list (a 10 MB prompt would otherwise hold the GIL for 100s of ms)."""
        # encode_batch(_fast) releases the GIL while the Rust tokenizer works (encode holds it), so
        # a large prompt tokenized on a worker thread never stalls the server's event loop; the
        # fast variant skips character offsets, which we never read.
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)
        if limit is not None and len(text) > (head_chars := HEAD_CHARS_PER_TOKEN * (limit + HEAD_MARGIN)):
            # Far longer than `limit` tokens usually span: a head that already holds more than
            # limit + HEAD_MARGIN tokens settles it (cutting the text changes at most the tokens of
            # its last word), without spending seconds of CPU on a 10 MB prompt.
            head = len(encode([text[:head_chars]], add_special_tokens=add_special_tokens)[0])
            if head > limit + HEAD_MARGIN:
                raise TooManyTokens(head, at_least=True)
        enc = encode([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(enc) > limit:
            raise TooManyTokens(len(enc))
        ids = enc.ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token's surface text (for logprobs), decoded so byte-level pieces read as text."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    # ---- chat -----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            **kwargs: Any) -> str:
        """Render like transformers' `apply_chat_template(..., tools=..., tokenize=False)`
        (consort_common/chat_template.py: the one rendering, which routers reproduce)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        if self._compiled is None:
            self._compiled = ChatTemplate(self.chat_template, self.special_tokens)
        return self._compiled.render(messages, add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message, tools=tools, **kwargs)

    def encode_chat(self, text: str, limit: int | None = None) -> list[int]:
        """Tokenize a rendered chat: the template already wrote the special tokens (as transformers does)."""
        return self.encode(text, add_special_tokens=False, limit=limit)

    def published(self, tokenizer_json: str) -> dict:
        """What a router needs to compute this engine's prompt token ids (GET /v1/kv/tokenizer): the
        checkpoint's tokenizer.json, the BOS rule, and the chat template with the special tokens it reads
        (None when there is none, or it is over MAX_PUBLISHED_TEMPLATE_CHARS: chats then route on
        characters). `revision` names all of it: a router keeps one copy per revision."""
        template = self.chat_template
        reply = {"tokenizer_json": tokenizer_json, "bos_token": self.bos_token, "add_bos_token": self.add_bos_token,
                 "chat_template": template if template and len(template) <= MAX_PUBLISHED_TEMPLATE_CHARS else None,
                 "special_tokens": self.special_tokens}
        digest = hashlib.sha256(json.dumps(reply, sort_keys=True).encode()).hexdigest()[:32]
        return {"revision": digest, **reply}


MAX_PUBLISHED_TEMPLATE_CHARS = 256 << 10     # real templates are a few KB (tool-heavy ones tens of KB)


# Prompts longer than HEAD_CHARS_PER_TOKEN characters per allowed token are counted on their head first.
HEAD_CHARS_PER_TOKEN = 64
HEAD_MARGIN = 64


class TooManyTokens(ValueError):
    """`count` tokens, or with `at_least` more than `count` (only the prompt's head was counted)."""

    def __init__(self, count: int, at_least: bool = False):
        super().__init__(f"{'more than ' if at_least else ''}{count} tokens")
        self.count = count
        self.at_least = at_least


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas (vLLM's prefix/read offset scheme).

    Decodes a short window before the new ids so merges at token boundaries (leading spaces,
    multi-byte characters split over tokens) come out right; holds text back while it ends in
    an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._trim()
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of the output)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _trim(self) -> None:
        if self.prefix_offset > 64:   # keep the window short; ids before prefix_offset are never read again
            del self.ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0


@dataclass(frozen=True)
class _StopAutomaton:
    """Aho-Corasick automaton over a request's stop strings. State = the longest suffix of the text so
    far that is a prefix of some stop string (a trie node), which is exactly the text the matcher must
    hold back; each character moves it in amortized O(1), whatever the number of stop strings.
    Testing every stop string against the text each step cost O(stops x text) on the event loop
    (150,000 stop strings: ~0.2 s per token per choice)."""
    goto: list[dict[str, int]]      # trie edges
    fail: list[int]                 # the longest proper suffix of a node's string that is a node too
    depth: list[int]                # the node's string length
    longest: list[int]              # length of the longest stop string ending at this node (0: none)
    max_len: int

    def step(self, node: int, ch: str) -> int:
        while True:
            nxt = self.goto[node].get(ch)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = self.fail[node]


@functools.lru_cache(maxsize=16)     # a request's n choices share their stops' automaton (<= 4,096 nodes)
def _stop_automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    goto: list[dict[str, int]] = [{}]
    depth, end = [0], [0]
    for s in stops:
        node = 0
        for ch in s:
            if ch not in goto[node]:
                goto[node][ch] = len(goto)
                goto.append({})
                depth.append(depth[node] + 1)
                end.append(0)
            node = goto[node][ch]
        end[node] = len(s)
    fail, longest = [0] * len(goto), list(end)
    queue = collections.deque(goto[0].values())     # breadth first: a node's fail link is shallower
    while queue:
        node = queue.popleft()
        for ch, child in goto[node].items():
            f = fail[node]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[child] = goto[f][ch] if node and ch in goto[f] else 0
            longest[child] = end[child] or longest[fail[child]]
            queue.append(child)
    return _StopAutomaton(goto, fail, depth, longest, max(map(len, stops)))


class StopStringMatcher:
    """Finds stop strings across deltas; never releases text that could be the start of one.

    `feed(delta) -> (text_to_emit, stopped)`. On a match the emitted text ends right before the
    earliest-starting stop string (the shortest of those starting there) and `stopped` is True;
    nothing is emitted after that. Each step costs O(len(delta)) (_StopAutomaton).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.automaton = _stop_automaton(tuple(self.stops)) if self.stops else None
        self.node = 0           # automaton state after the text fed so far; pending = its last depth chars
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        a = self.automaton
        if a is None:
            return delta, False
        buf = self.pending + delta
        node, first = self.node, None       # first: (start, end) in buf of the earliest-starting match
        for i, ch in enumerate(delta, len(self.pending)):
            if first is not None and i + 1 - a.max_len >= first[0]:
                break                       # no later match can start earlier
            node = a.step(node, ch)
            n = a.longest[node]
            if n and (first is None or i + 1 - n < first[0]):
                first = (i + 1 - n, i + 1)
        if first is not None:
            self.matched = buf[first[0]:first[1]]
            self.pending, self.stopped = "", True
            return buf[:first[0]], True
        self.node = node
        hold = a.depth[node]                # a match can only start inside the held text
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
