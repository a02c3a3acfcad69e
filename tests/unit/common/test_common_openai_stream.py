"""The benchmarks' stream reader: time to first token is the first chunk carrying a token (its text
may be held back by the server), not the chat's opening role chunk; text and chunk counts are the
content-bearing chunks."""
from __future__ import annotations

import json

from consort_common.openai_stream import StreamResult, _event


def line(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode()


def test_completion_first_token_with_empty_text_stamps_first():
    res, stamps, first = StreamResult(), [], []
    assert not _event(res, line({"choices": [{"index": 0, "text": ""}]}), stamps, first)
    assert len(first) == 1 and stamps == [] and res.chunks == 0
    _event(res, line({"choices": [{"index": 0, "text": "ab"}]}), stamps, first)
    assert len(first) == 1 and len(stamps) == 1 and res.text == "ab"
    assert _event(res, b"data: [DONE]", stamps, first) and res.outcome == "ok"


def test_chat_role_chunk_is_not_a_token():
    res, stamps, first = StreamResult(), [], []
    _event(res, line({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), stamps, first)
    assert first == []
    _event(res, line({"choices": [{"index": 0, "delta": {"content": ""}}]}), stamps, first)
    assert len(first) == 1 and stamps == []
    _event(res, line({"choices": [{"index": 0, "delta": {"content": "x"}}]}), stamps, first)
    assert len(stamps) == 1 and res.text == "x"


def test_usage_chunk_carries_prompt_completion_and_cached_tokens():
    res, stamps, first = StreamResult(), [], []
    _event(res, line({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 4,
                                               "prompt_tokens_details": {"cached_tokens": 32}}}), stamps, first)
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (40, 4, 32)
    other = StreamResult()
    _event(other, line({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}), stamps, first)
    assert other.cached_tokens == 0       # a server that does not say: nothing counted as cached
