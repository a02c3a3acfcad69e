"""The KV tier: prefix-cache blocks evicted from the pool, kept as files (or host memory) below it.

A block's file is `<root>/<layout id>/<hash hex>.kvb`: the block's K/V bytes, then (hybrid models,
when the engine holds one) the mixers' conv/SSM state checkpoint saved at the block's last token,
behind a header that names what they are (the layout identity: model, dtype, pool layout, block
size, shard, the state's shapes) and one checksum of both. A block is loaded only when all of
these match what this engine asks for; anything else (a torn or truncated file, another model's
or layout's block, flipped bits) is refused, counted and deleted, and the prefix is recomputed. Files are written to a temporary name
and renamed into place, so a reader never sees half a block: several replicas may share one
directory, and one replica's prefill serves another's prompt. The files outlive the process: an
engine restarted on the same directory starts warm.

Writes are asynchronous (a bounded queue and one writer thread: the engine loop only copies the
block out of the pool). The tier is bounded in bytes (this process's files, least recently used
first out). When the disk fails (full, read-only, gone) or a write takes longer than `slow_write_s`,
the tier turns itself off with one log line and `enabled = False` (a metric); the engine keeps
serving from its pool. With `path=None` the blocks live in host memory (GPU pods): same
bookkeeping, no files, nothing survives a restart.

Reads happen on the engine loop at admission (a hit replaces a prefill, which is much slower).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from pathlib import Path

from consort_engine.kv.events import KVEventLog

log = logging.getLogger("consort.kv_tier")

MAGIC = b"CONSORT-KV-BLOCK-1\n"
SUFFIX = ".kvb"
MAX_HEADER = 4096


def layout_dir(identity: str) -> str:
    """The directory name of one layout identity: engines with another layout never look there."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


# A block as stored: its K/V bytes and its state checkpoint's bytes (b"": none, or not a hybrid).
TierBlock = tuple[bytes, bytes]


def encode_block(identity: str, h: bytes, kv: bytes, state: bytes = b"") -> bytes:
    data = kv + state
    header = json.dumps({"identity": identity, "hash": h.hex(), "bytes": len(data), "state_bytes": len(state),
                         "checksum": hashlib.blake2b(data, digest_size=16).hexdigest()}).encode()
    return MAGIC + header + b"\n" + data


def decode_block(blob: bytes, identity: str, h: bytes) -> tuple[TierBlock | None, str]:
    """((K/V bytes, state bytes), "") when blob is block h of this identity, intact; else (None, why not)."""
    if not blob.startswith(MAGIC):
        return None, "bad magic"
    end = blob.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER)
    if end < 0:
        return None, "no header"
    try:
        header = json.loads(blob[len(MAGIC):end])
    except ValueError:
        return None, "bad header"
    data = blob[end + 1:]
    if not isinstance(header, dict) or header.get("identity") != identity:
        return None, "foreign layout"
    if header.get("hash") != h.hex():
        return None, "other block"
    if header.get("bytes") != len(data):
        return None, "truncated"
    if header.get("checksum") != hashlib.blake2b(data, digest_size=16).hexdigest():
        return None, "checksum mismatch"
    state = header.get("state_bytes", 0)
    if not isinstance(state, int) or not 0 <= state <= len(data):
        return None, "bad header"
    return (data[:len(data) - state], data[len(data) - state:]), ""


class KVTier:
    def __init__(self, path: str | None, max_bytes: int, identity: str, events: KVEventLog | None = None,
                 queue_blocks: int = 256, slow_write_s: float = 5.0) -> None:
        assert max_bytes > 0
        self.identity = identity
        self.max_bytes = max_bytes
        self.events = events
        self.slow_write_s = slow_write_s
        self.dir = Path(path) / layout_dir(identity) if path is not None else None
        self.kind = "memory" if self.dir is None else "disk"
        self.enabled = True
        self.disabled_reason = ""
        self._memory: dict[bytes, TierBlock] = {}
        self._lru: OrderedDict[bytes, int] = OrderedDict()   # hash -> bytes, this process's blocks
        self.bytes = 0
        self._lock = threading.Lock()
        # counters (metrics)
        self.hits = self.misses = self.rejected = self.written = self.dropped_writes = self.evicted = 0
        self.load_seconds = 0.0
        self._queue: queue.Queue[tuple[bytes, bytes, bytes] | None] = queue.Queue(maxsize=queue_blocks)
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._scan()
            except OSError as e:
                self._disable(f"cannot use {self.dir}: {e}")
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ reads (engine loop)
    def holds(self, h: bytes) -> bool:
        with self._lock:
            return h in self._lru

    def load(self, h: bytes) -> TierBlock | None:
        """Block h's (K/V bytes, state bytes), verified, or None (a miss, a refused block or a turned-off tier)."""
        if not self.enabled:
            return None
        t0 = time.perf_counter()
        if self.dir is None:
            with self._lock:
                data = self._memory.get(h)
        else:
            data = self._read_file(h)
        with self._lock:
            if data is None:
                self.misses += 1
                return None
            self.hits += 1
            self.load_seconds += time.perf_counter() - t0
            if h in self._lru:
                self._lru.move_to_end(h)
        return data

    def _read_file(self, h: bytes) -> TierBlock | None:
        path = self.dir / (h.hex() + SUFFIX)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            self._forget(h)        # another replica sharing the directory dropped it
            return None
        except OSError as e:
            self._disable(f"cannot read {path}: {e}")
            return None
        data, why = decode_block(blob, self.identity, h)
        if data is None:
            log.warning("KV tier: refused %s (%s); deleted, the prefix is recomputed", path.name, why)
            with self._lock:
                self.rejected += 1
            self._forget(h)
            try:
                path.unlink()
            except OSError:
                pass
        return data

    # ------------------------------------------------------------------ writes (queued)
    def save(self, h: bytes, kv: bytes, state: bytes = b"", wait: bool = False) -> None:
        """Queue block h (its K/V bytes and, for a hybrid, the state checkpoint at its end) for writing;
        dropped (counted) when the writer is behind (unless `wait`: at shutdown, up to a second for room)."""
        if not self.enabled:
            return
        try:
            self._queue.put((h, kv, state), block=wait, timeout=1.0 if wait else None)
        except queue.Full:
            with self._lock:
                self.dropped_writes += 1

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (or the tier is off); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self.enabled:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=5.0)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.enabled:
                    self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, h: bytes, kv: bytes, state: bytes) -> None:
        t0 = time.monotonic()
        if self.dir is None:
            with self._lock:
                self._memory[h] = (kv, state)
        else:
            path = self.dir / (h.hex() + SUFFIX)
            tmp = self.dir / f".{h.hex()}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(encode_block(self.identity, h, kv, state))
                os.replace(tmp, path)      # readers see the whole block or none
            except OSError as e:
                try:
                    tmp.unlink()
                except OSError:
                    pass
                self._disable(f"cannot write {path}: {e}")
                return
        took = time.monotonic() - t0
        self._add(h, len(kv) + len(state))
        if took > self.slow_write_s:
            self._disable(f"a block write took {took:.1f} s (limit {self.slow_write_s:.1f} s)")

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, h: bytes, size: int) -> None:
        victims = []
        with self._lock:
            if h in self._lru:
                self.bytes -= self._lru.pop(h)
            self._lru[h] = size
            self.bytes += size
            self.written += 1
            while self.bytes > self.max_bytes and len(self._lru) > 1:
                old, old_size = self._lru.popitem(last=False)
                self.bytes -= old_size
                self.evicted += 1
                self._memory.pop(old, None)
                victims.append(old)
        if self.events is not None:
            self.events.record("stored", "tier", [h])
            self.events.record("removed", "tier", victims)
        if self.dir is not None:
            for old in victims:
                try:
                    (self.dir / (old.hex() + SUFFIX)).unlink()
                except OSError:
                    pass

    def _forget(self, h: bytes) -> None:
        with self._lock:
            size = self._lru.pop(h, None)
            if size is None:
                return
            self.bytes -= size
            self._memory.pop(h, None)
        if self.events is not None:
            self.events.record("removed", "tier", [h])

    def _scan(self) -> None:
        """Adopt the blocks already in the directory (a restart), oldest first, within the bound."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    h = bytes.fromhex(entry.name[:-len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._add(h, size)
        self.written = 0
        if found:
            log.info("KV tier: %d blocks (%.0f MiB) found in %s", len(self._lru), self.bytes / 2**20, self.dir)

    def _disable(self, reason: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self.disabled_reason = reason
            self._lru.clear()
            self._memory.clear()
            self.bytes = 0
        log.error("KV tier turned off: %s; the engine goes on with its KV pool only", reason)
        if self.events is not None:
            self.events.record("cleared", "tier")

    def stats(self) -> dict:
        with self._lock:
            return {"kv_tier_enabled": self.enabled, "kv_tier_kind": self.kind, "kv_tier_bytes": self.bytes,
                    "kv_tier_max_bytes": self.max_bytes, "kv_tier_blocks": len(self._lru),
                    "kv_tier_hits": self.hits, "kv_tier_misses": self.misses, "kv_tier_rejected": self.rejected,
                    "kv_tier_written": self.written, "kv_tier_dropped_writes": self.dropped_writes,
                    "kv_tier_evicted": self.evicted, "kv_tier_load_seconds": self.load_seconds,
                    "kv_tier_disabled_reason": self.disabled_reason}
