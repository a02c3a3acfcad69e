"""Each lane's tokenizer and chat template, for precise prefix routing: from the directory the lane's router
config names (`tokenizer:`), else fetched once from one of the lane's engines (`GET /v1/kv/tokenizer`,
behind the engine credential the router's session carries), one copy per revision (lanes that share a
tokenizer and template share the copy). Loading (and compiling the template) takes tens to hundreds of
milliseconds: never on a request; until a lane's tokenizer is there, its text prompts and chats route
on character hashes.

A lane whose replicas change (a rollout: new pods) fetches again; a failed fetch (an engine without
the route, a network error) is retried after RETRY_S.
"""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .prompt_tokens import PromptTokenizer

log = logging.getLogger("consort.router.tokenizers")

RETRY_S = 30.0
MAX_BYTES = 64 << 20         # the largest tokenizer.json reply read (large vocabularies are ~10 MB)
MAX_REVISIONS = 32           # tokenizer copies kept (one per distinct revision the lanes' engines use)


class LaneTokenizers:
    def __init__(self) -> None:
        self.from_dirs: dict[str, PromptTokenizer | None] = {}       # directory -> loaded (None: unreadable)
        self.revisions: dict[str, PromptTokenizer] = {}              # engine revision -> loaded
        self.fetched: dict[str, tuple[float, frozenset[str], PromptTokenizer | None]] = {}  # lane -> (when, urls, tok)

    def load_dir(self, lane: str, path: str) -> None:
        if path in self.from_dirs:
            return
        try:
            self.from_dirs[path] = PromptTokenizer.from_dir(path)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
            log.warning("lane %s: tokenizer %s not loaded (%s); its text prompts route on character hashes",
                        lane, path, e)
            self.from_dirs[path] = None

    def get(self, lane: str, path: str | None, urls: list[str], session: aiohttp.ClientSession | None,
            spawn) -> PromptTokenizer | None:
        """The lane's tokenizer now (None: none yet). Without a directory, a fetch from `urls[0]` is
        started (`spawn`: the router's task set) when there is none for this replica set, or the last
        one failed RETRY_S ago."""
        if path is not None:
            return self.from_dirs.get(path)
        when, seen, tok = self.fetched.get(lane, (0.0, frozenset(), None))
        now, current = time.monotonic(), frozenset(urls)
        if urls and session is not None and (seen != current or (tok is None and now - when > RETRY_S)):
            self.fetched[lane] = (now, current, tok)   # the old one serves until the new one is there
            spawn(self.fetch(lane, urls[0], current, session))
        return tok

    async def fetch(self, lane: str, url: str, urls: frozenset[str], session: aiohttp.ClientSession) -> None:
        try:
            async with session.get(f"{url}/v1/kv/tokenizer", timeout=aiohttp.ClientTimeout(total=60)) as resp:
                size = int(resp.headers.get("Content-Length") or MAX_BYTES + 1)
                if resp.status != 200 or size > MAX_BYTES:
                    log.info("lane %s: no tokenizer from %s (HTTP %d, %d bytes)", lane, url, resp.status, size)
                    return
                reply = await resp.json(content_type=None)
            revision = reply.get("revision") if isinstance(reply, dict) else None
            if not isinstance(revision, str):
                raise ValueError("the reply names no revision")
            tok = self.revisions.get(revision)
            if tok is None:
                if len(self.revisions) >= MAX_REVISIONS:
                    self.revisions.clear()
                tok = self.revisions[revision] = await asyncio.to_thread(PromptTokenizer.from_engine, reply)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.info("lane %s: tokenizer fetch from %s failed (%s)", lane, url, e)
            return
        if self.fetched.get(lane, (0.0, frozenset(), None))[1] == urls:
            self.fetched[lane] = (time.monotonic(), urls, tok)
            log.info("lane %s: tokenizer revision %s from %s", lane, revision[:12], url)
