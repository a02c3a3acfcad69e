"""The engine credential (pure parts): which routes need it, constant-time checking, the file."""
from __future__ import annotations

import pytest

from consort_engine.serving import credential as C


def test_probes_are_open_and_metrics_only_without_its_own_port():
    for path in ("/v1/completions", "/v1/adapters", "/v1/status", "/tokenize", "/v1/models", "/version"):
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
