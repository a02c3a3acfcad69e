"""A checkpoint's jinja chat template: read from its files, and messages rendered to the prompt text as
transformers' `apply_chat_template(..., tools=..., tokenize=False)` does (the same sandboxed jinja2
environment, `raise_exception`, `tojson`, `strftime_now`, the special tokens as variables).

The engine renders every chat prompt with `ChatTemplate.render`; a router rebuilds the same
`ChatTemplate` from the engine's `GET /v1/kv/tokenizer` reply (the template source and the special
tokens) and renders a chat body with `render_body` to compute the engine's prompt token ids. The
rendered text is tokenized without special tokens added (the template wrote them), so no BOS rule
applies to a chat prompt. jinja2 is imported on first use only.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from consort_common.chat_messages import check_message, messages_for_template


class ChatTemplateError(ValueError):
    """The template is missing, or raised while rendering these messages (a client error)."""


def load_chat_template(model_dir: Path, cfg: dict) -> str | None:
    """The template source a checkpoint carries: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or the one named "default" of a list), else chat_template.json."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (model_dir / "chat_template.json").exists():
        template = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    return template if isinstance(template, str) else None


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def special_tokens(cfg: dict) -> dict[str, str]:
    """tokenizer_config.json's special tokens the template reads (a string, or an added token's
    {"content": ...})."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


@dataclass
class ChatTemplate:
    """One template source and the special tokens (bos_token, eos_token, unk_token, pad_token) it reads.
    Compiled on first render (a syntax error is a ChatTemplateError then); renders from any thread."""
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    _compiled: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def compiled(self):
        with self._lock:
            if self._compiled is None:
                import jinja2
                try:
                    self._compiled = _compile(self.source)
                except jinja2.exceptions.TemplateError as e:
                    raise ChatTemplateError(f"chat template: {e}") from e
            return self._compiled

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Checked messages (chat_messages.check_message) -> the prompt text. A template that ignores
        tools or tool calls sees them as Qwen2.5's template writes them (chat_messages.py)."""
        compiled = self.compiled()
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages = messages_for_template(messages, tools, self.source)
        import jinja2
        try:
            text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   tools=tools or None, **self.special_tokens, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from e
        if continue_final_message and messages:
            final = messages[-1].get("content")
            if isinstance(final, str) and final.strip() and final.strip() in text:
                text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text

    def render_body(self, body: dict) -> str | None:
        """A /v1/chat/completions body's prompt text as the engine renders it, or None when the engine
        would refuse the body or the template fails on it (the router then routes on characters).
        Reads the fields the engine's rendering uses: messages, tools, add_generation_prompt and
        continue_final_message (JSON null is a field's default, as the engine takes it)."""
        raw, tools = body.get("messages"), body.get("tools")
        flags = [body.get(k) for k in ("add_generation_prompt", "continue_final_message")]
        if (not isinstance(raw, list) or not raw or (tools is not None and not isinstance(tools, list))
                or any(f is not None and not isinstance(f, bool) for f in flags)):
            return None
        try:
            messages = [check_message(i, m) for i, m in enumerate(raw)]
            return self.render(messages, add_generation_prompt=flags[0] is not False,
                               continue_final_message=flags[1] is True, tools=tools or None)
        except Exception:  # noqa: BLE001 - MessageError, ChatTemplateError, or what a template raises on odd input
            return None
