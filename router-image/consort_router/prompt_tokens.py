"""A request's prompt token ids as the engine computes them, for precise prefix routing (affinity.py).

The engine (consort_engine/text/tokenizer.py) tokenizes a completion's `prompt` with the checkpoint's
`tokenizer.json` (the `tokenizers` library, special tokens on) and prepends the BOS token when
`tokenizer_config.json` says `add_bos_token` and the ids do not start with it. It renders a chat's
`messages` (and `tools`) with the checkpoint's jinja chat template through
consort_common/chat_template.py and tokenizes the text without special tokens (the template wrote
them). `PromptTokenizer` does the same from the same files (a lane's `tokenizer:` directory in the
router config) or from what the engine publishes (`GET /v1/kv/tokenizer`), rendering with the same
module; a Responses body (`input`, `instructions`, `tools`) is first mapped to the chat it means
by the engine's own mapping. A prompt given as token ids needs no tokenizer. A chat whose template the router does not
have, or that fails to render here, gives None and the lane falls back to the character-hash policy.

Only the head of a long prompt is tokenized (the blocks a router matches are its first
`max_blocks`): the text is cut at `HEAD_CHARS_PER_TOKEN` characters per token wanted, and when it was
cut the tokens of the last block are dropped (cutting a word changes its last tokens), so every
id returned is the engine's. A chat is rendered whole (a template may read every message), then cut.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer

from consort_common.chat_messages import MessageError
from consort_common.chat_template import ChatTemplate, ChatTemplateError, load_chat_template, special_tokens
from consort_common.responses_input import chat_prompt as responses_chat_prompt

log = logging.getLogger("consort.router.tokenizers")

HEAD_CHARS_PER_TOKEN = 8       # text per token tokenized (English runs about 4 characters a token)
OFF_LOOP_CHARS = 4096          # a longer prompt is tokenized on a worker thread (about a millisecond and up)


def off_loop(tokenizer: PromptTokenizer | None, body: dict, text: str) -> bool:
    """Whether this body's ids are computed on a worker thread: a prompt over OFF_LOOP_CHARS characters, or
    any chat the router renders (jinja is pure Python, and its cost follows fields `text` does not count:
    tools, tool calls, whatever else a template reads; a short chat costs 0.2-0.4 ms, one with tools about
    1 ms, a 100,000-character one 10 ms and up: docs/prefix-affinity.md)."""
    return len(text) > OFF_LOOP_CHARS or (is_chat(body) and tokenizer is not None and tokenizer.chat is not None)


def compiled_or_none(template: ChatTemplate) -> ChatTemplate | None:
    """The template compiled now (off the request path), or None when it does not compile here: the
    lane's chats then route on character hashes (its completions still route precisely)."""
    try:
        template.compiled()
    except ChatTemplateError as e:
        log.warning("chat template not usable for routing (%s); chats route on character hashes", e)
        return None
    return template


class PromptTokenizer:
    def __init__(self, hf: Tokenizer, bos_token: object, add_bos_token: object, chat: ChatTemplate | None) -> None:
        self.hf = hf
        self.bos_id = hf.token_to_id(bos_token) if isinstance(bos_token, str) and add_bos_token is True else None
        self.chat = chat

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "PromptTokenizer":
        """A checkpoint directory's tokenizer.json and tokenizer_config.json (a lane's `tokenizer`)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a lane's `tokenizer` names a checkpoint directory)")
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        special, template = special_tokens(cfg), load_chat_template(model_dir, cfg)
        return cls(Tokenizer.from_file(str(path)), special.get("bos_token"), bool(cfg.get("add_bos_token", False)),
                   compiled_or_none(ChatTemplate(template, special)) if template else None)

    @classmethod
    def from_engine(cls, reply: dict) -> "PromptTokenizer":
        """An engine's GET /v1/kv/tokenizer reply (what the engine itself tokenizes and renders with). Raises
        ValueError on another shape, or a tokenizer.json the library cannot read; a reply without a chat
        template (an older engine, a checkpoint without one) gives a tokenizer for completions only."""
        text = reply.get("tokenizer_json")
        if not isinstance(text, str):
            raise ValueError("the reply has no tokenizer_json")
        template, special = reply.get("chat_template"), reply.get("special_tokens") or {}
        if not (isinstance(special, dict) and all(isinstance(v, str) for v in special.values())):
            raise ValueError("special_tokens is not an object of strings")
        chat = compiled_or_none(ChatTemplate(template, special)) if isinstance(template, str) and template else None
        try:
            hf = Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
            raise ValueError(f"tokenizer_json is not a tokenizer: {e}") from None
        return cls(hf, reply.get("bos_token"), reply.get("add_bos_token"), chat)

    def encode_head(self, text: str, tokens: int, drop_tail: int, chat: bool = False) -> list[int]:
        """The first `tokens` ids of text (fewer when it is shorter), exact: see the module docstring.
        `chat`: a rendered chat, tokenized without special tokens and without the BOS rule."""
        head = text[:HEAD_CHARS_PER_TOKEN * tokens]
        ids = self.hf.encode_batch_fast([head], add_special_tokens=not chat)[0].ids
        if not chat and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        if len(head) < len(text):
            ids = ids[:max(0, len(ids) - drop_tail)]
        return ids[:tokens]


def is_chat(body: dict) -> bool:
    """A chat body (`messages`) or a Responses body (`input`): rendered by the chat template."""
    return "messages" in body or "input" in body


def chat_text(template: ChatTemplate, body: dict) -> str | None:
    """A chat or Responses body's prompt text as the engine renders it (None: the engine would refuse it,
    or the template fails on it). A Responses body is mapped to its chat messages first, by the
    engine's own mapping (consort_common/responses_input.py)."""
    if "input" in body:
        try:
            body = responses_chat_prompt(body)
        except MessageError:
            return None
    return template.render_body(body)


def prompt_ids(tokenizer: PromptTokenizer | None, body: dict, tokens: int, drop_tail: int) -> list[int] | None:
    """The first `tokens` prompt token ids the engine will compute for this body (a completion's `prompt`,
    a chat's `messages`, a Responses body's `input`), or None when the router cannot know them exactly
    (no tokenizer or no chat template, several prompts, a malformed prompt, a body with the fields
    of two kinds)."""
    prompt = body.get("prompt")
    if is_chat(body):
        if prompt is not None or ("messages" in body and "input" in body) or tokenizer is None or tokenizer.chat is None:
            return None
        text = chat_text(tokenizer.chat, body)
        return tokenizer.encode_head(text, tokens, drop_tail, chat=True) if text is not None else None
    if prompt is None:
        return None
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]                      # one prompt in a list: the engine serves it alone
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt[:tokens]
    if isinstance(prompt, str) and tokenizer is not None:
        return tokenizer.encode_head(prompt, tokens, drop_tail)
    return None
