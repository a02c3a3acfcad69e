"""Streaming: a token whose text is held back (it may begin a stop string) still gets its chunk, with
empty text, as vLLM sends it, so a client sees the first token when it is made; the text comes whole
once it is known not to be the stop string, and nothing of a stop string is ever sent."""
from __future__ import annotations

import json

import httpx

PROMPT = "int main() { return"


def stream(engine, **extra) -> list[dict]:
    body = {"model": "spec", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}
    chunks = []
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return [c for c in chunks if c.get("choices")]


def test_a_held_back_first_token_still_gets_its_chunk(engine):
    plain = stream(engine)
    text = "".join(c["choices"][0]["text"] for c in plain)
    first = plain[0]["choices"][0]["text"]
    assert first, "the first token decodes to text on its own"
    # A stop string that begins with the first token's text and never occurs: that text is held back
    # (it could be the start of the stop string) until the next tokens rule it out.
    stop = first + "\u2603never"
    assert stop not in text
    held = stream(engine, stop=[stop])
    assert held[0]["choices"][0]["text"] == ""             # the first token's chunk, its text held
    assert "".join(c["choices"][0]["text"] for c in held) == text   # nothing lost, nothing doubled
    assert len(held) >= len(plain)
