"""POST /tokenize and /detokenize bodies (vLLM's shapes), as pydantic models with the same typed 400s
as the generation bodies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from consort_engine.serving.errors import bad
from consort_engine.serving.fields import AdapterField, Bool, Raw, Str, check_message, checked, is_int
from consort_engine.serving.request_models import unknown_fields
from consort_engine.text import tool_calls


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True          # a prompt gets BOS; a chat template writes its own specials
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    adapter: str | None = None               # same tokenizer; named only so the model check matches generation
    tools: tool_calls.ToolChoice | None = None   # rendered with the messages, as a chat request renders them
    ignored_fields: list[str] = field(default_factory=list)


def _messages(v: Any, key: str) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("invalid_type", "'messages' must be a non-empty list", "messages")
    return [check_message(i, m) for i, m in enumerate(v)]


class TokenizeBody(BaseModel):
    """A text prompt, or a chat's messages (rendered as a chat request renders them)."""
    model_config = ConfigDict(extra="ignore")
    model: Str
    adapter: AdapterField
    return_token_strs: Bool()
    prompt: Raw
    messages: checked(None, _messages)
    tools: Raw
    add_special_tokens: Bool(None)           # default: True for a prompt, False for messages
    add_generation_prompt: Bool(True)
    continue_final_message: Bool()


def parse_tokenize(body: Any) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise bad("invalid_json", "request body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise bad("missing_field", "give exactly one of 'prompt' (text) or 'messages' (a chat)", "prompt")
    b = TokenizeBody.model_validate(body)
    req = TokenizeRequest(model=b.model, adapter=b.adapter, return_token_strs=b.return_token_strs,
                          ignored_fields=unknown_fields(body, TokenizeBody))
    if "messages" in body:
        if b.messages is None:
            raise bad("invalid_type", "'messages' must be a non-empty list", "messages")
        req.messages = b.messages
        try:
            req.tools = tool_calls.parse_tools({"tools": b.tools})
        except tool_calls.ToolsError as e:
            raise bad(e.code, e.message, e.param) from None
        req.add_special_tokens = bool(b.add_special_tokens)
        req.add_generation_prompt = b.add_generation_prompt
        req.continue_final_message = b.continue_final_message
    else:
        if not isinstance(b.prompt, str):
            raise bad("invalid_type", "'prompt' must be a string", "prompt")
        req.prompt = b.prompt
        req.add_special_tokens = b.add_special_tokens is not False
    return req


def _tokens(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise bad("invalid_type", "'tokens' must be a list of token ids", "tokens")
    return list(v)


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Str
    adapter: AdapterField
    tokens: checked(None, _tokens)


def parse_detokenize(body: Any) -> DetokenizeBody:
    if not isinstance(body, dict):
        raise bad("invalid_json", "request body must be a JSON object")
    b = DetokenizeBody.model_validate(body)
    if b.tokens is None:
        raise bad("invalid_type", "'tokens' must be a list of token ids", "tokens")
    return b
