"""`consort model-cache` against a temp directory standing in for the node's cache: miss then hit,
two processes fetching one model once, a corrupted entry refused and fetched again, the byte bound."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

from consort_engine.model_cache import MANIFEST, ModelCache, fetch

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def checkpoint(root: Path, name: str, size: int) -> str:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "model.safetensors").write_bytes(os.urandom(size))
    (d / "sub").mkdir()
    (d / "sub" / "tokenizer.json").write_text("{}")
    return f"file://{d}"


def same_files(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "consort_common.cli", "model-cache", *args], env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_demo_model_miss_builds_then_hit_copies(tmp_path):
    cache, term = tmp_path / "cache", tmp_path / "termination-log"
    first = run_cli("--cache-dir", str(cache), "--termination-log", str(term), "demo://tiny?seed=2", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    kind, source, size, seconds = first.stdout.split()[2:]
    assert first.stdout.startswith("model cache miss demo://tiny?seed=2 ") and int(size) > 1_000_000
    assert term.read_text() == first.stdout
    second = run_cli("--cache-dir", str(cache), "--termination-log", str(term), "demo://tiny?seed=2", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith(f"model cache hit demo://tiny?seed=2 {size} ")
    assert term.read_text() == second.stdout
    assert same_files(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").stat().st_size > 1_000_000


def test_hybrid_demo_model_is_a_bamba_and_unknown_demo_names_are_refused(tmp_path):
    import json

    out = run_cli("--cache-dir", str(tmp_path / "cache"), "--termination-log", "", "demo://tiny-bamba?seed=1",
                  str(tmp_path / "h"))
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["model_type"] == "bamba" and cfg["attn_layer_indices"] == [3] and cfg["num_hidden_layers"] == 4
    for bad in ("demo://tiny-mamba", "demo://lora"):
        refused = run_cli("--cache-dir", "", "--termination-log", "", bad, str(tmp_path / "x"))
        assert refused.returncode == 2 and bad in refused.stderr and not (tmp_path / "x").exists()


def test_unusable_cache_dir_is_bypassed(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    src = checkpoint(tmp_path, "src", 1000)
    out = run_cli("--cache-dir", str(blocker / "cache"), "--termination-log", "", src, str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    assert "model cache unusable" in out.stderr
    assert out.stdout.startswith(f"model cache bypass {src} ")
    assert same_files(Path(src[len("file://"):]), tmp_path / "t")


def counting_fetch(log: Path):
    def fetch_counted(source: str, revision: str, out: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)          # long enough that the other process asks while this one fetches
        fetch(source, revision, out)
    return fetch_counted


def materialize_in_child(root: str, source: str, target: str, log: str, start: float, results) -> None:
    while time.time() < start:
        time.sleep(0.005)
    out = ModelCache(Path(root), 1 << 30).materialize(source, Path(target), counting_fetch(Path(log)))
    results.put(out.result)


def test_two_processes_fetch_once(tmp_path):
    src = checkpoint(tmp_path, "src", 200_000)
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    start = time.time() + 0.5
    procs = [ctx.Process(target=materialize_in_child,
                         args=(str(tmp_path / "cache"), src, str(tmp_path / f"t{i}"), str(tmp_path / "fetches"),
                               start, results)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted([results.get(timeout=5), results.get(timeout=5)]) == ["hit", "miss"]
    assert len((tmp_path / "fetches").read_text().split()) == 1
    for i in range(2):
        assert same_files(Path(src[len("file://"):]), tmp_path / f"t{i}")


def test_corrupted_entry_is_refused_and_fetched_again(tmp_path):
    src = checkpoint(tmp_path, "src", 50_000)
    cache = ModelCache(tmp_path / "cache", 1 << 30)
    fetches = tmp_path / "fetches"
    assert cache.usable() is None
    assert cache.materialize(src, tmp_path / "t1", counting_fetch(fetches)).result == "miss"
    (entry,) = (tmp_path / "cache" / "entries").iterdir()
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1234] ^= 0xFF                                  # same size, one flipped byte
    weights.write_bytes(bytes(data))
    out = cache.materialize(src, tmp_path / "t2", counting_fetch(fetches))
    assert out.result == "miss" and len(fetches.read_text().split()) == 2
    assert same_files(Path(src[len("file://"):]), tmp_path / "t2")
    # a torn entry (a file gone) and a missing manifest are refetched too
    (entry / "sub" / "tokenizer.json").unlink()
    assert cache.materialize(src, tmp_path / "t3", counting_fetch(fetches)).result == "miss"
    (entry / MANIFEST).unlink()
    assert cache.materialize(src, tmp_path / "t4", counting_fetch(fetches)).result == "miss"
    assert cache.materialize(src, tmp_path / "t5", counting_fetch(fetches)).result == "hit"
    assert len(fetches.read_text().split()) == 4
    assert same_files(Path(src[len("file://"):]), tmp_path / "t5")


def test_byte_bound_evicts_least_recently_used(tmp_path):
    sources = [checkpoint(tmp_path, f"m{i}", 100_000) for i in range(3)]
    cache = ModelCache(tmp_path / "cache", 250_000)           # room for two entries
    assert cache.usable() is None
    entries = tmp_path / "cache" / "entries"
    assert cache.materialize(sources[0], tmp_path / "t", fetch).result == "miss"
    assert cache.materialize(sources[1], tmp_path / "t", fetch).result == "miss"
    os.utime(next(entries.glob("*m0-*")), (time.time() - 100, time.time() - 100))
    os.utime(next(entries.glob("*m1-*")), (time.time() - 200, time.time() - 200))
    assert cache.materialize(sources[0], tmp_path / "t", fetch).result == "hit"   # m0 now most recent
    assert cache.materialize(sources[2], tmp_path / "t", fetch).result == "miss"  # evicts m1
    assert sorted(p.name.rsplit("-", 1)[0][-2:] for p in entries.iterdir()) == ["m0", "m2"]
    assert sum(e.size for e in cache.entries()) <= 250_000
    dead = tmp_path / "cache" / "tmp" / "gone-0123.4242"       # a fetch whose process died half-way
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 1000)
    assert cache.materialize(sources[1], tmp_path / "t", fetch).result == "miss"
    assert same_files(Path(sources[1][len("file://"):]), tmp_path / "t")
    assert not dead.exists() and list((tmp_path / "cache" / "tmp").iterdir()) == []
