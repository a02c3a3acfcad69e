"""Chat prompts: the router's token ids and block hashes for a /v1/chat/completions body are the engine's.

The engine side is the engine's own path (parse_chat, prepare.render_chat, Tokenizer.encode_chat, the
block manager's registered blocks and events); the router side is what it builds from the engine's
`GET /v1/kv/tokenizer` reply (Tokenizer.published, through JSON) or from a lane's tokenizer directory,
and prompt_tokens.prompt_ids + affinity.precise_affinity. Templates in the style of each model family
the repository's checkpoints stand for: the demo template (every demo Llama / Qwen2 / Qwen3 / Bamba
checkpoint carries it; it knows neither tools nor tool calls), a Llama 3.1-style template (BOS in the
template, add_bos_token on, tools as JSON, tool results as ipython turns), a Qwen2.5 / Qwen3-style one
(tools and tool_calls known, consecutive tool results in one user turn) and a Granite-style one as
IBM's Bamba / Granite checkpoints ship (tools known, tool calls not: the Hermes rewriting applies)."""
from __future__ import annotations

import json
import time

import pytest

from consort_common.block_hash import prefix_salt
from consort_engine.demo_model import CHAT_TEMPLATE, train_tokenizer, write_tokenizer
from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.events import KVEventLog
from consort_engine.kv.sequence import SamplingParams, Sequence
from consort_engine.serving.prepare import render_chat
from consort_engine.serving.protocol import parse_chat
from consort_engine.serving.responses import to_chat
from consort_engine.text.tokenizer import Tokenizer
from consort_router.affinity import precise_affinity
from consort_router.config import ReplicaChoice
from consort_router.kv_index import ReplicaBlocks
from consort_router.prompt_tokens import PromptTokenizer, off_loop, prompt_ids

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- elif message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "parameters": ' + (tool_call.function.arguments | tojson) + '}' }}
        {%- endfor %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

GRANITE = """{%- if tools %}
    {{- '<|start_of_role|>available_tools<|end_of_role|>\\n' }}
    {%- for tool in tools %}{{- tool | tojson(indent=4) }}{%- if not loop.last %}{{- '\\n\\n' }}{%- endif %}{%- endfor %}
    {{- '<|end_of_text|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {{- '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
    {%- else %}
        {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
    {%- endif %}
    {%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
{%- endfor %}
"""

# family -> (template, where the checkpoint keeps it, add_bos_token)
FAMILIES = {"demo": (CHAT_TEMPLATE, "config", False), "llama3": (LLAMA3, "jinja", True),
            "qwen": (QWEN, "config", False), "granite": (GRANITE, "named", False)}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = "You are a careful C++ reviewer. Answer briefly and quote the standard where it helps. " * 3
BODIES = {
    "system-user": {"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": "Why does std::vector<bool> surprise people?"}]},
    "multi-turn": {"messages": [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "What is ADL?"},
                                {"role": "assistant", "content": "Argument-dependent lookup: café — ✓ 数字."},
                                {"role": "user", "content": [{"type": "text", "text": "And two-phase "},
                                                             {"type": "text", "text": "lookup?"}]}]},
    "tools": {"tools": TOOLS, "tool_choice": "auto", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "user", "content": "Thanks. And tomorrow?"}]},
    "tools-no-system": {"tools": TOOLS, "messages": [{"role": "user", "content": "What time is it? " * 8}]},
    "continue-final": {"add_generation_prompt": False, "continue_final_message": True, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a loop."},
        {"role": "assistant", "content": "for (int i = 0; i < n; ++i) {"}]},
    "long": {"messages": [{"role": "system", "content": SYSTEM}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: template <typename T> struct S{i} {{}};"}
        for i in range(120)]},
}


FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
RESPONSES = {   # /v1/responses bodies: the engine maps them to chat (consort_common/responses_input.py)
    "text": {"instructions": SYSTEM, "input": "Why does std::vector<bool> surprise people?"},
    "items": {"instructions": SYSTEM, "tools": FLAT_TOOLS, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "user", "content": "And tomorrow?"}]},
}


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    return train_tokenizer(1024, limit_bytes=600_000)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tokenizer_model, tmp_path_factory):
    """The demo tokenizer with the family's chat template, kept where that family's checkpoints keep it."""
    template, where, add_bos = FAMILIES[request.param]
    d = tmp_path_factory.mktemp(f"chat-{request.param}")
    write_tokenizer(d, tokenizer_model, 4096)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = add_bos
    cfg["chat_template"] = {"config": template, "jinja": None, "named": [{"name": "tool_use", "template": "x"},
                                                                         {"name": "default", "template": template}]}[where]
    if where == "jinja":
        del cfg["chat_template"]
        (d / "chat_template.jinja").write_text(template)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def engine_ids(tok: Tokenizer, body: dict) -> list[int]:
    """The engine's prompt ids for a chat body: its request parsing, rendering and tokenizing."""
    return tok.encode_chat(render_chat(tok, parse_chat({"model": "Algo", **body})))


def engine_responses_ids(tok: Tokenizer, body: dict) -> list[int]:
    """The engine's prompt ids for a Responses body: mapped to chat as prepare() maps it, then the chat path."""
    return engine_ids(tok, to_chat({"model": "Algo", **body}))


def routers(checkpoint) -> dict[str, PromptTokenizer]:
    tok = Tokenizer.from_dir(checkpoint)
    reply = json.loads(json.dumps(tok.published((checkpoint / "tokenizer.json").read_text())))
    return {"engine": PromptTokenizer.from_engine(reply), "directory": PromptTokenizer.from_dir(checkpoint)}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_router_chat_ids_are_the_engines(checkpoint, name):
    body = BODIES[name]
    tok = Tokenizer.from_dir(checkpoint)
    want = engine_ids(tok, body)
    assert len(want) > 32
    for source, router in routers(checkpoint).items():
        assert router.chat is not None, source
        assert prompt_ids(router, body, 100_000, 16) == want, source
        head = prompt_ids(router, body, 64, 16)    # a long chat: only its head, every id the engine's
        assert head == want[:len(head)] and (len(head) >= 48 or len(want) < 64), source


@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_router_responses_ids_are_the_engines(checkpoint, name):
    body = RESPONSES[name]
    want = engine_responses_ids(Tokenizer.from_dir(checkpoint), body)
    assert len(want) > 32
    for source, router in routers(checkpoint).items():
        assert prompt_ids(router, body, 100_000, 16) == want, source


def test_router_chat_hashes_are_the_engines_registered_blocks(checkpoint):
    """The engine registers a chat prompt's blocks under its adapter and the salt of its tenant and
    cache_salt; the router's precise affinity of the same body finds all of them on that replica, and
    none under another tenant, salt or adapter."""
    body = {**BODIES["tools"], "cache_salt": "s1"}
    tok = Tokenizer.from_dir(checkpoint)
    ids = engine_ids(tok, body)
    log = KVEventLog()
    bm = BlockManager(num_blocks=256, block_size=16, namespace="Algo", events=log)
    seq = Sequence(list(ids), SamplingParams(), adapter="v2", cache_salt=prefix_salt("team-a", "s1"))
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    view = ReplicaBlocks(max_hashes=10_000)
    view.apply(log.read(None, None))
    rc = ReplicaChoice()
    router = routers(checkpoint)["engine"]
    router_ids = prompt_ids(router, body, 4096, 16)
    aff = precise_affinity(rc, {"r": view}, 16, router_ids, body, "Algo", "v2", "team-a")
    assert aff.precise and len(aff.hashes) == len(ids) // 16 and aff.depth == {"r": len(aff.hashes)}
    for other_body, adapter, tenant in ((body, "v2", "team-b"), (BODIES["tools"], "v2", "team-a"),
                                        (body, None, "team-a")):
        assert precise_affinity(rc, {"r": view}, 16, router_ids, other_body, "Algo", adapter, tenant).depth == {}


def test_a_chat_the_router_cannot_render_falls_back(checkpoint):
    """No template published (an older engine, none in the checkpoint), a template that fails on the
    body, or a body the engine would refuse: None (the lane routes on character hashes), never an error."""
    tok = Tokenizer.from_dir(checkpoint)
    reply = tok.published((checkpoint / "tokenizer.json").read_text())
    bare = PromptTokenizer.from_engine({**reply, "chat_template": None})
    failing = PromptTokenizer.from_engine({**reply, "chat_template": "{{ raise_exception('no') }}"})
    broken = PromptTokenizer.from_engine({**reply, "chat_template": "{% for %}"})
    router = PromptTokenizer.from_engine(reply)
    body = BODIES["multi-turn"]
    assert bare.chat is None and prompt_ids(bare, body, 64, 16) is None
    assert broken.chat is None and failing.chat is not None       # compiled when the tokenizer is loaded
    assert prompt_ids(failing, body, 64, 16) is None and prompt_ids(broken, body, 64, 16) is None
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                {"messages": [{"role": "user", "content": "x"}], "tools": "all"},
                {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
                {"messages": "hi"}, {"messages": [{"role": "user", "content": "x"}], "prompt": "y"},
                {"input": ""}, {"input": [{"type": "image"}]}, {"input": "x", "instructions": 5},
                {"input": "x", "tools": [{"type": "web_search"}]}, {"input": "x", "messages": []}):
        assert prompt_ids(router, bad, 64, 16) is None, bad
    with pytest.raises(ValueError):
        PromptTokenizer.from_engine({**reply, "special_tokens": {"bos_token": 5}})
    # every chat the router renders runs on a worker thread; one it cannot render costs nothing there
    assert off_loop(router, body, "short") and not off_loop(bare, body, "short")
    assert not off_loop(router, {"prompt": "short"}, "short") and off_loop(router, {"prompt": "x"}, "x" * 5000)


def test_the_published_revision_names_the_template_too(checkpoint):
    tok = Tokenizer.from_dir(checkpoint)
    text = (checkpoint / "tokenizer.json").read_text()
    first = tok.published(text)
    assert first["chat_template"] == tok.chat_template and first["special_tokens"]["bos_token"] == "<s>"
    tok.chat_template = tok.chat_template + " "
    assert tok.published(text)["revision"] != first["revision"]
    tok.chat_template = "x" * (300 << 10)           # over the published bound: chats route on characters
    assert tok.published(text)["chat_template"] is None


def test_rendering_a_long_conversation_costs(checkpoint, capsys):
    """Not a timing assertion: prints what rendering and tokenizing a chat costs the router (it runs every
    chat it renders on a worker thread)."""
    router = routers(checkpoint)["engine"]
    body = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": "int f(int x) { return x; } " * 10}
                         for i in range(400)]}
    text_chars = sum(len(m["content"]) for m in body["messages"])
    for label, b in (("short", BODIES["multi-turn"]), ("tools", BODIES["tools"]), (f"{text_chars} chars", body)):
        prompt_ids(router, b, 1024, 16)
        start = time.perf_counter()
        for _ in range(20):
            ids = prompt_ids(router, b, 1024, 16)
        assert ids
        with capsys.disabled():
            print(f"\n{checkpoint.name[:-1]}: {label}: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms per body")
