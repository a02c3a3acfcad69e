"""/tokenize and /detokenize replies (vLLM's shapes)."""
from __future__ import annotations

from aiohttp import web

from consort_engine.serving.context import ServerContext
from consort_engine.serving.tokenize_request import TokenizeRequest


def tokenize_reply(ctx: ServerContext, req: TokenizeRequest, ids: list[int]) -> web.Response:
    token_strs = [ctx.tokenizer.hf.id_to_token(i) for i in ids] if req.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                              "token_strs": token_strs})


def detokenize_reply(text: str) -> web.Response:
    return web.json_response({"prompt": text})
