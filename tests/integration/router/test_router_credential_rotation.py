"""Rotating the engine credential without a restart or a failed request, the way the operator does it
through Secret volumes (files swapped behind a `..data` link): the engine follows its credential
directory, accepts the staged token before the router sends it and the previous one after, and the
router follows its `current` file."""
from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

import procs

pytestmark = pytest.mark.timeout(300)
OLD, CUR, NEW = "cred-old-0000", "cred-current-1111", "cred-new-2222"
_stamps = itertools.count()


def write_secret_volume(root: Path, files: dict[str, str]) -> None:
    """What the kubelet does on a Secret update: write a new timestamped dir, repoint `..data` at it
    atomically, and keep the visible names as links through `..data`."""
    root.mkdir(exist_ok=True)
    stamp = root / f"..{time.time_ns()}_{next(_stamps)}"
    stamp.mkdir()
    for name, text in files.items():
        (stamp / name).write_text(text)
    tmp = root / "..data_tmp"
    os.symlink(stamp.name, tmp)
    old = os.readlink(root / "..data") if (root / "..data").is_symlink() else None
    os.replace(tmp, root / "..data")
    for name in files:
        if not (root / name).is_symlink():
            os.symlink(f"..data/{name}", root / name)
    if old:
        for f in (root / old).iterdir():
            f.unlink()
        (root / old).rmdir()


def accepts(engine, token: str) -> bool:
    return httpx.get(engine.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code == 200


def test_rotation_through_secret_volumes_drops_no_request(demo_model, logs, tmp_path, make_router):
    engine_dir, router_dir = tmp_path / "engine-credentials", tmp_path / "router-credential"
    write_secret_volume(engine_dir, {"ensemble": f"{CUR}\n{OLD}\n"})
    write_secret_volume(router_dir, {"current": f"{CUR}\n"})
    e = procs.start_engine(demo_model, logs, "--num-blocks", "64", "--credential-file", str(engine_dir), name="Rot")
    try:
        assert accepts(e, CUR) and accepts(e, OLD) and not accepts(e, NEW)
        r = make_router({"ensemble": "cpp", "specialists": [{"name": "Rot", "replicas": [e.url]}],
                         "default_specialist": "Rot", "store": {"kind": "none"}, "reload_interval_s": 0.2,
                         "polling": {"interval_s": 0.2},
                         "auth": {"engine_credential_file": str(router_dir / "current")}})
        body = {"model": "cpp", "prompt": "int main() {", "max_tokens": 1, "temperature": 0}
        assert r.post("/v1/completions", body).status_code == 200

        codes: list[int] = []
        stop = threading.Event()

        def traffic() -> None:
            deadline = time.monotonic() + 120           # stops by itself
            while not stop.is_set() and time.monotonic() < deadline:
                codes.append(r.post("/v1/completions", body).status_code)

        t = threading.Thread(target=traffic, daemon=True)
        t.start()
        try:
            # 1. stage: the engines learn the new token first (the router still sends the current one)
            write_secret_volume(engine_dir, {"ensemble": f"{NEW}\n{CUR}\n{OLD}\n"})
            procs.wait_until(lambda: accepts(e, NEW), 20, what="the engine accepting the staged token")
            # 2. promote: the router sends the new token; the engines keep the previous one
            write_secret_volume(router_dir, {"current": f"{NEW}\n"})
            write_secret_volume(engine_dir, {"ensemble": f"{NEW}\n{CUR}\n"})
            procs.wait_until(lambda: not accepts(e, OLD), 20, what="the engine dropping the oldest token")
            assert accepts(e, CUR), "the previous token stays accepted during the rotation"
            time.sleep(1.0)                             # the router's file check runs every 0.2 s
            # 3. only the new token left: the router must be presenting it
            write_secret_volume(engine_dir, {"ensemble": f"{NEW}\n"})
            procs.wait_until(lambda: not accepts(e, CUR), 20, what="the engine dropping the previous token")
            n = len(codes)
            procs.wait_until(lambda: len(codes) >= n + 5, 30, what="more requests through the router")
        finally:
            stop.set()
            t.join(60)
        assert codes and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
        # the router's metrics name the lane and replica index, never the engine's address or a token
        metrics = httpx.get(r.url + "/metrics", timeout=10).text
        assert 'specialist="Rot"' in metrics
        for secret in (f"127.0.0.1:{e.port}", f":{e.port}", CUR, NEW):
            assert secret not in metrics, secret
    finally:
        e.stop()
