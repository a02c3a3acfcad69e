"""Prefix affinity: which replica most likely holds a prompt's prefix in its KV cache.

The engines cache KV by a chain of block hashes (each block's hash covers every token before it), so
a replica can reuse a prompt's prefix only if it served that prefix before. The router does not
tokenize, so it keeps the same shape over text: the prompt is cut into fixed-size character blocks,
each hash chaining the previous one, and `PrefixIndex` remembers for each hash the replicas that
served a prompt containing that block (LRU, bounded). Two prompts that share their first k blocks
share their first k hashes; the replica with the deepest match is the one to ask. `choose_replica`
(replicas.py) balances that against queue depth.

Precise mode: when the router knows the prompt's token ids exactly as the engine computes them
(prompt_tokens.py) and follows the lane's replicas' block events (kv_index.py), it computes the
engine's own block hashes (consort_common/block_hash.py) and reads each replica's depth from what
the replica says it holds, instead of from where the router sent earlier prompts.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field

from consort_common.block_hash import prefix_salt
from consort_common.block_hash import prefix_hashes as block_hashes

from .config import ReplicaChoice
from .kv_index import ReplicaBlocks


@dataclass(frozen=True)
class Affinity:
    """What one request brings to the replica choice."""

    hashes: tuple[bytes, ...]   # chained block hashes of its prompt (may be empty: nothing to match)
    depth: dict[str, float]     # replica url -> leading blocks it holds (precise) or served before
    load_slack: float           # the affine replica wins while its load <= least load + this
    precise: bool = False       # engine block hashes scored from block events (else character hashes)
    views: dict[str, ReplicaBlocks] | None = field(default=None, compare=False)   # precise: told where it went
    chain: dict[str, int] = field(default_factory=dict)   # precise: url -> leading blocks held, any medium

    def blocks_held(self, url: str) -> int:
        """Leading blocks of the prompt `url` holds (in character mode, its depth)."""
        return self.chain.get(url, int(self.depth.get(url, 0)))

    def sent(self, url: str, prefixes: "PrefixIndex") -> None:
        """The request went to `url` and was accepted: remember its blocks there (precise: expected in
        that replica's view until its events confirm them; else in the character-hash index)."""
        if self.precise:
            view = (self.views or {}).get(url)
            if view is not None:
                view.expect(self.hashes)
        else:
            prefixes.record(self.hashes, url)


def prefix_hashes(text: str, salt: str, block_chars: int, max_blocks: int) -> tuple[bytes, ...]:
    """Chained hashes of the full `block_chars` blocks of `text` (a partial tail block is not cached by
    the engines either), at most `max_blocks`. `salt` keeps lanes and adapters apart: the same text
    on another adapter has other KV."""
    out: list[bytes] = []
    prev = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    n = min(len(text) // block_chars, max_blocks)
    for i in range(n):
        block = text[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        out.append(prev)
    return tuple(out)


class PrefixIndex:
    """Block hash -> replica urls that served it, least recently used hashes forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, set[str]] = OrderedDict()

    def match(self, hashes: tuple[bytes, ...]) -> dict[str, int]:
        """url -> how many leading blocks of `hashes` it holds (only urls holding at least one)."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            urls = self.entries.get(h)
            if not urls:
                break
            # A chain: a replica holds block i only if it also holds blocks 0..i-1 (for this prompt).
            alive = set(urls) if alive is None else alive & urls
            if not alive:
                break
            for u in alive:
                depth[u] = i + 1
        return depth

    def record(self, hashes: tuple[bytes, ...], url: str) -> None:
        """`url` now holds every block of this prompt."""
        for h in hashes:
            urls = self.entries.get(h)
            if urls is None:
                self.entries[h] = {url}
            else:
                urls.add(url)
                self.entries.move_to_end(h)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def forget(self, url: str) -> None:
        """A replica that left (or restarted) holds nothing."""
        for h in [h for h, urls in self.entries.items() if url in urls]:
            urls = self.entries[h]
            urls.discard(url)
            if not urls:
                del self.entries[h]

    def __len__(self) -> int:
        return len(self.entries)


def precise_affinity(rc: ReplicaChoice, blocks: dict[str, ReplicaBlocks], block_size: int, ids: list[int],
                     body: dict, target: str, adapter: object, tenant: str) -> Affinity:
    """The engine's block hashes of a prompt's token ids `ids` (prompt_tokens.prompt_ids) on lane `target`
    and each followed replica's depth in them. The extra keys are the engine's: the specialist name,
    the adapter, and the salt formed from the tenant the router sends (x-consort-tenant) and the
    body's cache_salt."""
    salt = body.get("cache_salt")
    hashes = tuple(block_hashes(ids, block_size, target, adapter if isinstance(adapter, str) else None,
                                prefix_salt(tenant, salt if isinstance(salt, str) else None)))
    matches = {url: m for url, view in blocks.items() if (m := view.match(hashes))[0] > 0}
    return Affinity(hashes, {url: m[0] for url, m in matches.items()}, rc.load_slack, precise=True, views=blocks,
                    chain={url: m[1] for url, m in matches.items()})


def request_affinity(rc: ReplicaChoice, prefixes: PrefixIndex, body: dict, text: str, target: str,
                     adapter: object, tenant: str) -> Affinity | None:
    """A request's prefix blocks on lane `target` (salted by lane and adapter: other weights, other
    KV; and by tenant and cache_salt, as the engines salt their caches) and how deep each replica
    holds them; None when the lane picks by load only."""
    if rc.policy != "prefix-affine":
        return None
    prompt = body.get("prompt")
    text = text or (json.dumps(prompt) if isinstance(prompt, list) else "")  # token ids: their digits
    salt = body.get("cache_salt")
    hashes = prefix_hashes(text, f"{target}\0{adapter or ''}\0{tenant}\0{salt if isinstance(salt, str) else ''}",
                           rc.block_chars, rc.max_blocks)
    return Affinity(hashes, prefixes.match(hashes), rc.load_slack)
