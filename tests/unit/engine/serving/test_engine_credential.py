"""The engine credential (pure parts): which routes need it, constant-time checking, the file."""
from __future__ import annotations

import pytest

from consort_engine.serving import credential as C


def test_probes_are_open_and_metrics_only_without_its_own_port():
    for path in ("/v1/completions", "/v1/adapters", "/v1/status", "/tokenize", "/v1/models", "/version",
                 "/v1/kv/events", "/v1/kv/tokenizer"):
        assert C.needs_credential(path, metrics_port=False) and C.needs_credential(path, metrics_port=True)
    for path in ("/health", "/ready"):
        assert not C.needs_credential(path, False) and not C.needs_credential(path, True)
    assert not C.needs_credential("/metrics", metrics_port=False)
    assert C.needs_credential("/metrics", metrics_port=True)


def test_presented_accepts_any_listed_credential_as_bearer():
    d = C.parse_credentials("# rotation: new, then old\nnew-cred\n\nold-cred\n")
    assert len(d) == 2
    assert C.presented(d, "Bearer new-cred") and C.presented(d, "bearer old-cred ")
    for bad in (None, "", "Bearer", "Bearer other", "new-cred", "Basic new-cred"):
        assert not C.presented(d, bad), bad
    assert not C.presented((), "Bearer new-cred")


def test_read_credentials(tmp_path, monkeypatch):
    monkeypatch.delenv(C.CREDENTIAL_ENV, raising=False)
    assert C.read_credentials(None) == ()                  # not configured: open, as before
    p = tmp_path / "cred"
    p.write_text("s3cret\n")
    assert C.read_credentials(str(p)) == C.parse_credentials("s3cret")
    monkeypatch.setenv(C.CREDENTIAL_ENV, str(p))
    assert C.read_credentials(None) == C.parse_credentials("s3cret")
    p.write_text("# nothing\n")
    with pytest.raises(ValueError):
        C.read_credentials(str(p))                         # configured but empty: refuse to start open
    with pytest.raises(FileNotFoundError):
        C.read_credentials(str(tmp_path / "missing"))


def test_a_directory_accepts_every_file_and_an_empty_one_is_closed(tmp_path):
    d = tmp_path / "creds"
    d.mkdir()
    src = C.CredentialSource(str(d))
    closed = src.read()
    assert closed == C.CLOSED and not C.presented(closed, "Bearer anything") and not C.presented(closed, "Bearer ")
    (d / "router-a").write_text("a-new\na-old\n")
    (d / "router-b").write_text("b-cur\n")
    (d / "..data").mkdir()            # a Secret volume's own entries are skipped
    got = src.reread()
    assert got is not None and len(got) == 3
    assert all(C.presented(got, f"Bearer {t}") for t in ("a-new", "a-old", "b-cur"))
    assert src.reread() is None       # unchanged


def test_reread_follows_a_rewritten_or_swapped_file(tmp_path):
    p = tmp_path / "cred"
    p.write_text("one\n")
    src = C.CredentialSource(str(p))
    assert C.presented(src.read(), "Bearer one")
    assert src.reread() is None
    p.write_text("two\none\n")          # same inode, new size / mtime
    got = src.reread()
    assert got is not None and C.presented(got, "Bearer two") and C.presented(got, "Bearer one")
    q = tmp_path / "cred.new"           # what a Secret volume does: a new file takes the name
    q.write_text("three\n")
    q.replace(p)
    got = src.reread()
    assert got is not None and C.presented(got, "Bearer three") and not C.presented(got, "Bearer two")


def test_follow_keeps_the_last_good_credentials_when_the_file_turns_bad(tmp_path):
    import asyncio

    p = tmp_path / "cred"
    p.write_text("good\n")
    src = C.CredentialSource(str(p))
    seen: list[tuple[bytes, ...]] = [src.read()]

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(src.follow(seen.append, stop, every=0.01))
        await asyncio.sleep(0.05)
        p.write_text("# emptied\n")     # unreadable as credentials: ignored, logged
        await asyncio.sleep(0.05)
        p.write_text("next\n")
        for _ in range(200):
            if C.presented(seen[-1], "Bearer next"):
                break
            await asyncio.sleep(0.01)
        stop.set()
        await task

    asyncio.run(run())
    assert all(d for d in seen) and C.presented(seen[-1], "Bearer next")
    assert not any(d == () for d in seen)
