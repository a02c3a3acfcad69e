"""`consort model-cache SOURCE TARGET ...`: fill each TARGET with SOURCE's checkpoint through the node-local cache.

A cold pod on a node that served a model before copies it from local disk instead of downloading
(hf://) or building (demo://) it again. An engine pod's init container runs it with the node's cache
directory (a hostPath) mounted:

    <cache>/entries/<key>/        one checkpoint, with manifest.json (sha256 and size of every file)
    <cache>/locks/<key>.lock      flock: shared while a pod copies the entry, exclusive while one fetches it
    <cache>/tmp/<key>.<pid>/      a fetch in progress, renamed into entries/ once whole

The key names the source and its revision (the hub commit of an hf:// source, the engine version of a
demo:// build, a listing digest of a file:// directory), so a moved branch is a new entry. Every use
copies the entry into the pod's own volume and checks each file's sha256 on the way: a torn or
tampered entry is dropped and fetched again, and the engine never reads the node's directory. Two
pods asking for one model on one node fetch it once (the second waits on the lock, then copies).
Past the byte bound, the least recently used entries that no pod is copying are evicted.
Each source prints one line, `model cache hit|miss|bypass SOURCE BYTES SECONDS`, also written to
the container's termination message (the pod's status shows it). A cache directory that cannot be
used (missing, not writable by the pod's user) is bypassed: the pod fetches as if there were none.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from consort_common.demo_source import parse_demo_model
from consort_common.help import HelpFormatter

MANIFEST = "manifest.json"
CHUNK = 4 << 20
COMMIT = re.compile(r"^[0-9a-f]{40}$")


# ---- pure decisions ----------------------------------------------------------------------------

def cache_key(source: str, revision: str) -> str:
    """The entry's directory name: the end of the source (readable on the node), then a digest of
    (source, revision)."""
    digest = hashlib.sha256(f"{source}\n{revision}".encode()).hexdigest()[:24]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", source.split("://", 1)[-1])[-48:].strip("._-")
    return f"{slug}-{digest}"


@dataclass(frozen=True)
class FileSum:
    size: int
    sha256: str


def manifest_problems(manifest: dict[str, FileSum], observed: dict[str, FileSum]) -> list[str]:
    """What makes an entry unusable: a file missing, extra, of another size or another digest."""
    problems = [f"missing {p}" for p in sorted(manifest.keys() - observed.keys())]
    problems += [f"unexpected {p}" for p in sorted(observed.keys() - manifest.keys())]
    problems += [f"changed {p}" for p in sorted(manifest.keys() & observed.keys()) if manifest[p] != observed[p]]
    return problems


@dataclass(frozen=True)
class Entry:
    key: str
    size: int
    last_used: float


def evictions(entries: list[Entry], max_bytes: int, busy: frozenset[str]) -> list[str]:
    """Keys to delete, least recently used first, until the cache fits max_bytes; entries being
    copied or fetched (busy) stay, so the cache may stay over its bound until they are released."""
    total = sum(e.size for e in entries)
    out = []
    for e in sorted(entries, key=lambda e: (e.last_used, e.key)):
        if total <= max_bytes:
            break
        if e.key not in busy:
            out.append(e.key)
            total -= e.size
    return out


def parse_manifest(text: str) -> dict[str, FileSum]:
    files = json.loads(text)["files"]
    return {p: FileSum(int(v["size"]), str(v["sha256"])) for p, v in files.items()}


# ---- sources: revision and fetch --------------------------------------------------------------------

def engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("consort")
    except PackageNotFoundError:
        return "source-tree"


def listing_digest(root: Path) -> str:
    """A file:// directory's identity without reading it: names, sizes and modification times."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def source_revision(source: str) -> str:
    """What the key pins: an hf:// branch or tag resolves to its commit (a moved branch is a new entry)."""
    if source.startswith("hf://"):
        repo, _, rev = source[len("hf://"):].partition("@")
        if COMMIT.match(rev):
            return rev
        from huggingface_hub import HfApi

        return HfApi().model_info(repo, revision=rev or None).sha
    if source.startswith("demo://"):
        return f"consort-{engine_version()}"
    if source.startswith("file://"):
        return listing_digest(Path(source[len("file://"):]))
    raise ValueError(f"model cache: unsupported source {source!r} (hf://, demo:// or file://)")


def fetch(source: str, revision: str, out: Path) -> None:
    """Write the checkpoint of `source` at `revision` into the new directory `out`."""
    if source.startswith("hf://"):
        from huggingface_hub import snapshot_download

        repo = source[len("hf://"):].partition("@")[0]
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(out))
        shutil.rmtree(out / ".cache", ignore_errors=True)   # the hub client's own bookkeeping
    elif source.startswith("demo://"):
        from consort_engine.demo_model import SIZES, write_demo_model

        demo = parse_demo_model(source)
        s = SIZES[demo.size]
        write_demo_model(out, arch=demo.arch, hidden=s.hidden, layers=s.layers, heads=s.heads,
                         kv_heads=s.kv_heads, ffn=s.ffn, vocab=s.vocab, max_pos=s.max_pos, seed=demo.seed)
    elif source.startswith("file://"):
        shutil.copytree(source[len("file://"):], out)
    else:
        raise ValueError(f"model cache: unsupported source {source!r}")


# ---- files ---------------------------------------------------------------------------------------

def files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p != root / MANIFEST)


def file_sum(path: Path) -> FileSum:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return FileSum(path.stat().st_size, h.hexdigest())


def write_manifest(entry: Path, source: str, revision: str) -> int:
    sums = {p: file_sum(entry / p) for p in files_of(entry)}
    doc = {"source": source, "revision": revision,
           "files": {p: {"size": s.size, "sha256": s.sha256} for p, s in sums.items()}}
    with open(entry / MANIFEST, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return sum(s.size for s in sums.values())


def copy_verified(entry: Path, target: Path) -> tuple[int, list[str]]:
    """Copy the entry's files into target, hashing them on the way (one read of each file).
    Returns (bytes, problems); with problems, target holds a partial copy."""
    try:
        manifest = parse_manifest((entry / MANIFEST).read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        return 0, [f"manifest unreadable: {e}"]
    observed: dict[str, FileSum] = {}
    for rel in files_of(entry):
        if rel not in manifest:
            observed[rel] = FileSum(-1, "")
            continue
        dst = target / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        with open(entry / rel, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(CHUNK):
                h.update(chunk)
                fo.write(chunk)
                size += len(chunk)
        observed[rel] = FileSum(size, h.hexdigest())
    return sum(s.size for s in observed.values() if s.size > 0), manifest_problems(manifest, observed)


def clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def flocked(path: Path, mode: int) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)   # closing drops the lock


# ---- the cache -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    result: str        # hit, miss or bypass
    source: str
    size: int
    seconds: float

    def line(self) -> str:
        return f"model cache {self.result} {self.source} {self.size} {self.seconds:.2f}"


Fetch = Callable[[str, str, Path], None]


@dataclass(frozen=True)
class ModelCache:
    root: Path
    max_bytes: int

    def prepare(self) -> None:
        for sub in ("entries", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def usable(self) -> str | None:
        """Why the cache cannot be used, or None."""
        try:
            self.prepare()
            probe = self.root / "tmp" / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            return f"{self.root}: {e.strerror or e}"
        return None

    def lock_path(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def materialize(self, source: str, target: Path, fetch_fn: Fetch = fetch) -> Outcome:
        """Make target a verified copy of source's checkpoint, from the cache when it holds it."""
        t0 = time.monotonic()
        self.prepare()
        revision = source_revision(source)
        key = cache_key(source, revision)
        entry = self.root / "entries" / key
        result = "hit"
        with flocked(self.lock_path(key), fcntl.LOCK_SH):
            size = self._copy(entry, target)
            if size is not None:
                os.utime(entry)   # last used: what eviction orders by
        if size is None:
            with flocked(self.lock_path(key), fcntl.LOCK_EX):
                size = self._copy(entry, target)   # another pod may have fetched it while we waited
                if size is None:
                    result = "miss"
                    self._fetch(source, revision, key, entry, fetch_fn)
                    size = self._copy(entry, target)
                    if size is None:
                        raise RuntimeError(f"model cache: {entry} fails its manifest right after the fetch")
                os.utime(entry)
        self.evict()
        return Outcome(result, source, size, time.monotonic() - t0)

    def _copy(self, entry: Path, target: Path) -> int | None:
        if not (entry / MANIFEST).is_file():
            return None
        clear(target)
        target.mkdir(parents=True)
        size, problems = copy_verified(entry, target)
        if not problems:
            return size
        print(f"model cache: {entry.name} refused ({'; '.join(problems[:3])}): fetching again", file=sys.stderr)
        clear(target)
        return None

    def _fetch(self, source: str, revision: str, key: str, entry: Path, fetch_fn: Fetch) -> None:
        """Under the key's exclusive lock: fetch into tmp/, write the manifest, rename into place."""
        for stale in (self.root / "tmp").glob(f"{key}.*"):    # a fetch that died half-way
            clear(stale)
        tmp = self.root / "tmp" / f"{key}.{os.getpid()}"
        fetch_fn(source, revision, tmp)
        write_manifest(tmp, source, revision)
        clear(entry)
        os.rename(tmp, entry)

    def entries(self) -> list[Entry]:
        out = []
        for d in (self.root / "entries").iterdir():
            try:
                try:
                    files = json.loads((d / MANIFEST).read_text())["files"]
                    size = sum(int(v["size"]) for v in files.values())
                except (ValueError, KeyError, TypeError, FileNotFoundError):   # torn: still takes space
                    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
                out.append(Entry(d.name, size, d.stat().st_mtime))
            except FileNotFoundError:
                continue     # evicted by another pod meanwhile
        return out

    @contextlib.contextmanager
    def idle_locks(self, keys: list[str]) -> Iterator[set[str]]:
        """Take each key's lock exclusively if nobody holds it; yields the keys whose lock is held
        elsewhere (busy). The locks taken are held until the block ends."""
        held: list[int] = []
        busy: set[str] = set()
        try:
            for key in keys:
                fd = os.open(self.lock_path(key), os.O_RDWR | os.O_CREAT, 0o640)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held.append(fd)
                except OSError as err:
                    os.close(fd)
                    if err.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    busy.add(key)
            yield busy
        finally:
            for fd in held:
                os.close(fd)

    def drop_dead_fetches(self) -> None:
        """tmp/ directories of fetches whose process died (nobody holds their key's lock)."""
        dirs = list((self.root / "tmp").glob("*.*"))
        keys = sorted({d.name.rsplit(".", 1)[0] for d in dirs if not d.name.startswith(".")})
        with self.idle_locks(keys) as busy:
            for d in dirs:
                if not d.name.startswith(".") and d.name.rsplit(".", 1)[0] not in busy:
                    clear(d)

    def evict(self) -> list[str]:
        """Delete least recently used entries past max_bytes; an entry whose lock another process
        holds (being copied or fetched) is busy and stays."""
        self.drop_dead_fetches()
        entries = self.entries()
        if sum(e.size for e in entries) <= self.max_bytes:
            return []
        with self.idle_locks([e.key for e in entries]) as busy:
            chosen = evictions(entries, self.max_bytes, frozenset(busy))
            for key in chosen:
                clear(self.root / "entries" / key)
        return chosen


def materialize_direct(source: str, target: Path, fetch_fn: Fetch = fetch) -> Outcome:
    """No usable cache: fetch straight into target."""
    t0 = time.monotonic()
    clear(target)
    fetch_fn(source, source_revision(source), target)
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
    return Outcome("bypass", source, size, time.monotonic() - t0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="consort model-cache", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("pairs", nargs="+", metavar="SOURCE TARGET",
                    help="a source (hf://ORG/NAME[@REV], demo://NAME[?seed=N], file:///DIR) and the "
                         "directory to fill with its checkpoint; repeat for more")
    ap.add_argument("--cache-dir", default="", help="the node's cache directory ('' fetches without a cache)")
    ap.add_argument("--max-bytes", type=int, default=100 << 30,
                    help="evict least recently used entries past this many bytes")
    ap.add_argument("--termination-log", default="/dev/termination-log",
                    help="also write the outcome lines here (the pod status shows them); '' skips")
    a = ap.parse_args(argv)
    if len(a.pairs) % 2:
        ap.error("expected SOURCE TARGET pairs")
    if a.max_bytes < 0:
        ap.error("--max-bytes must be >= 0")
    for source in a.pairs[::2]:
        if not source.startswith(("hf://", "demo://", "file://")):
            ap.error(f"{source!r} is not an hf://, demo:// or file:// source")
        if source.startswith("demo://"):
            try:
                parse_demo_model(source)
            except ValueError as e:
                ap.error(str(e))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cache = ModelCache(Path(a.cache_dir), a.max_bytes) if a.cache_dir else None
    why = cache.usable() if cache else "no --cache-dir"
    if cache and why:
        print(f"model cache unusable, fetching without it: {why}", file=sys.stderr)
    lines = []
    for source, target in zip(a.pairs[::2], a.pairs[1::2]):
        out = materialize_direct(source, Path(target)) if why else cache.materialize(source, Path(target))
        print(out.line(), flush=True)
        lines.append(out.line())
    if a.termination_log:
        with contextlib.suppress(OSError):
            Path(a.termination_log).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
