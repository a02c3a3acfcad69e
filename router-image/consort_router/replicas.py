"""Replica state and choice: warm replicas only, prefix-affine within a load slack, else least queue depth
(with a penalty for preempting ones).

The poller (`ReplicaPoller`) keeps `ReplicaState` fresh from each engine's `/ready` and `/v1/status`;
`choose_replica` is the pure decision.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

import aiohttp

from .affinity import Affinity
from .periodic import Periodic

log = logging.getLogger("consort.router.replicas")


@dataclass
class ReplicaState:
    url: str
    specialist: str
    ready: bool = False
    reason: str = "not polled yet"
    waiting: int = 0
    running: int = 0
    preempting: bool = False
    polled_at: float = 0.0
    inflight: int = 0            # router requests to it now in flight
    inflight_at_poll: int = 0    # ... when its status was last read
    adapters: tuple[str, ...] = ()
    max_model_len: int | None = None   # the engine's, from its status (the router's model cards)
    block_size: int | None = None      # the engine's KV block size, from its status (precise prefix hashes)

    def load(self, preempting_penalty: float) -> float:
        """Queue depth as seen now: polled depth + requests sent since the poll, + preempting penalty."""
        pending = max(0, self.inflight - self.inflight_at_poll)
        return self.waiting + self.running + pending + (preempting_penalty if self.preempting else 0.0)

    def view(self) -> dict:
        return {
            "url": self.url, "ready": self.ready, "reason": self.reason, "waiting": self.waiting,
            "running": self.running, "preempting": self.preempting, "inflight": self.inflight,
            "adapters": list(self.adapters),
        }


# The share of a prompt's blocks a replica must hold for its prefix to outweigh load (SGLang's router
# has the same rule, cache_threshold 0.5): a shared system prompt ahead of a long message of its own
# is cheaper to recompute on an idle replica than to queue for on a busy one.
MIN_AFFINE_SHARE = 0.5


def choose_replica(
    replicas: list[ReplicaState], preempting_penalty: float, exclude: frozenset[str] = frozenset(),
    adapter: str | None = None, affinity: Affinity | None = None,
) -> ReplicaState | None:
    """The ready replica (not in `exclude`) to send a request to.

    Adapter-aware: a request for an adapter goes to the replicas that report it loaded, when any
    does (during a rollout or a hot-load some replicas have it and some do not yet). When none does,
    the least-loaded replica answers, typed (404 adapter_not_found) if it cannot serve it either.

    Without `affinity` (or a prompt too short to hash): the least load; ties go to the fewest in
    flight, then URL. With it, among the replicas whose load is within `load_slack` of the least:
    the one holding the deepest prefix of the prompt, as long as it holds at least
    MIN_AFFINE_SHARE of the prompt's blocks (pool or tier). A replica further above the least load
    than the slack is not worth its cache hits: the request spills to the least-loaded one. A
    prefix shorter than that share (typically a system prompt every conversation shares, ahead of a
    long message of its own) is not worth a queue: the least-loaded replica takes the request, of
    equally loaded ones the one holding more of it, so conversations that share a system prompt
    spread over idle replicas instead of queueing on the first one that served it. A prompt no
    replica holds any of goes where its first block hashes to (rendezvous hashing), so prompts that
    share a beginning meet on one replica and different ones spread.

    Replicas that tie (the same deepest prefix; or, equally loaded, the same short one) are told
    apart by rendezvous hashing on the first block past what they hold (the last block when they
    hold it all), never by in-flight counts: every router replica in front of the same engines
    sends a conversation to the same replica, and so does its next turn when its history was
    evicted everywhere and the engines are equally loaded (its block at that index is unchanged)."""
    candidates = [r for r in replicas if r.ready and r.url not in exclude]
    if adapter is not None:
        candidates = [r for r in candidates if adapter in r.adapters] or candidates
    if not candidates:
        return None
    loads = {r.url: r.load(preempting_penalty) for r in candidates}
    least = min(candidates, key=lambda r: (loads[r.url], r.inflight, r.url))
    if affinity is None or not affinity.hashes:
        return least
    near = [r for r in candidates if loads[r.url] <= loads[least.url] + affinity.load_slack]
    affine = [r for r in candidates if holds_enough(affinity, r.url)]
    if affine:
        near = [r for r in near if r in affine]
        if not near:
            return least  # the prefix is on a replica too busy to wait for: spill
        return deepest_of(near, affinity, lambda r: (affinity.depth[r.url], affinity.blocks_held(r.url)))
    if not affinity.depth:
        return rendezvous(near, affinity.hashes[0])
    idle = [r for r in candidates if loads[r.url] == loads[least.url]]
    return deepest_of(idle, affinity, lambda r: (affinity.blocks_held(r.url), affinity.depth.get(r.url, 0)))


def deepest_of(replicas: list[ReplicaState], affinity: Affinity, rank) -> ReplicaState:
    """Of `replicas`, those with the highest `rank` (a tuple that includes blocks_held, so the tied
    hold the same blocks), told apart by rendezvous hashing on the prompt's first block past them."""
    top = max(rank(r) for r in replicas)
    tied = [r for r in replicas if rank(r) == top]
    return rendezvous(tied, affinity.hashes[min(affinity.blocks_held(tied[0].url), len(affinity.hashes) - 1)])


def rendezvous(replicas: list[ReplicaState], key: bytes) -> ReplicaState:
    """The replica `key` hashes to (highest random weight): the same for every router that sees the
    same replicas, and moving only the keys of a replica that comes or goes."""
    return max(replicas, key=lambda r: hashlib.blake2b(key + r.url.encode(), digest_size=8).digest())


def holds_enough(affinity: Affinity, url: str) -> bool:
    """Whether the replica holds a prefix of the prompt worth routing to: MIN_AFFINE_SHARE of its blocks."""
    return affinity.depth.get(url, 0) > 0 and affinity.blocks_held(url) >= MIN_AFFINE_SHARE * len(affinity.hashes)


def choice_outcome(affinity: Affinity | None, chosen: ReplicaState) -> str:
    """How a choice went, for consort_router_replica_choice_total: affine (sent where enough of its
    prefix is), spill (enough of it is elsewhere, on a replica too loaded), short_prefix (replicas hold
    less than MIN_AFFINE_SHARE of it, typically a shared system prompt: the load decided), cold (no
    replica holds any of it), least_loaded (no affinity asked: policy off, or a prompt shorter than
    one block)."""
    if affinity is None or not affinity.hashes:
        return "least_loaded"
    if holds_enough(affinity, chosen.url):
        return "affine"
    if any(holds_enough(affinity, url) for url in affinity.depth):
        return "spill"
    return "short_prefix" if affinity.depth else "cold"


def parse_status(body: object) -> tuple[int, int, bool, tuple[str, ...]]:
    """(waiting, running, preempting, adapters) from an engine's /v1/status JSON, tolerant of shapes."""
    if not isinstance(body, dict):
        return 0, 0, False, ()

    def num(key: str) -> int:
        v = body.get(key, 0)
        if isinstance(v, bool):
            return int(v)
        if isinstance(v, (int, float)):
            return int(v)
        if isinstance(v, (list, tuple)):
            return len(v)
        return 0

    pre = body.get("preempting", False)
    preempting = bool(pre) if not isinstance(pre, (list, tuple, dict)) else len(pre) > 0
    adapters = body.get("adapters") or ()
    if isinstance(adapters, dict):
        adapters = tuple(adapters)
    elif isinstance(adapters, list):
        adapters = tuple(a if isinstance(a, str) else str(a.get("name", "")) for a in adapters if a)
    else:
        adapters = ()
    return num("waiting"), num("running"), preempting, adapters


# An engine whose mounted credentials do not hold this router's token yet (the kubelet brings a
# Secret's new content to a running pod within its sync period, about a minute).
CREDENTIAL_REFUSED = "the engine refuses this router's engine credential"


class ReplicaPoller(Periodic):
    """Polls every replica's /ready and /v1/status in the background."""

    task_name = "replica-poller"

    def __init__(self, session: aiohttp.ClientSession, interval_s: float, timeout_s: float) -> None:
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.replicas: dict[str, ReplicaState] = {}  # url -> state (shared with the router's table)
        self.first_round = asyncio.Event()

    def track(self, replicas: dict[str, ReplicaState]) -> None:
        self.replicas = replicas

    async def poll_one(self, r: ReplicaState) -> None:
        inflight = r.inflight
        try:
            async with self.session.get(f"{r.url}/ready", timeout=self.timeout) as resp:
                ready = resp.status == 200
                reason = "ready" if ready else (await resp.text())[:200]
            async with self.session.get(f"{r.url}/v1/status", timeout=self.timeout) as resp:
                status = await resp.json(content_type=None) if resp.status == 200 else {}
                if resp.status in (401, 403):   # its requests would be refused too: not ready for this router
                    ready, reason = False, CREDENTIAL_REFUSED
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            r.ready, r.reason = False, f"unreachable: {type(e).__name__}"
            r.polled_at = time.monotonic()
            return
        r.waiting, r.running, r.preempting, r.adapters = parse_status(status)
        max_len = status.get("max_model_len") if isinstance(status, dict) else None
        r.max_model_len = max_len if isinstance(max_len, int) and not isinstance(max_len, bool) else None
        bs = status.get("block_size") if isinstance(status, dict) else None
        r.block_size = bs if isinstance(bs, int) and not isinstance(bs, bool) and 0 < bs <= 4096 else None
        r.ready, r.reason = ready, reason
        r.inflight_at_poll = inflight
        r.polled_at = time.monotonic()

    async def poll_all(self) -> None:
        reps = list(self.replicas.values())
        if reps:
            await asyncio.gather(*(self.poll_one(r) for r in reps))
        self.first_round.set()
