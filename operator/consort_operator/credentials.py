"""Reading an EnsembleRouter's Secrets for its reconcile pass (lifecycle/credential.py decides what they
should hold; the handler writes them with the other children), remembering its engine credential
for the operator's own probes of the engines (probe.py), and the tokens its engines accept for the
Specialists it selects (AcceptedTokens: read again only when the router's status digest moves)."""
from __future__ import annotations

from typing import Any

from .kube import Kube
from .lifecycle.credential import (ROTATE_ANNOTATION, RouterSecrets, accepted_digest, accepted_text, ours,
                                  state_from_secret)
from .probe import Prober
from .resources.credential import api_keys_secret_name, engine_credential_secret_name


async def observe_router_secrets(kube: Kube, prober: Prober | None, body: Any) -> RouterSecrets:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    credential = await kube.get("Secret", namespace, engine_credential_secret_name(name))
    keys = await kube.get("Secret", namespace, api_keys_secret_name(name))
    state = state_from_secret(ours(credential, engine_credential_secret_name(name), meta["uid"]))
    if prober is not None and state is not None:
        prober.tokens[(namespace, name)] = state.current
    return RouterSecrets(credential, keys, str((meta.get("annotations") or {}).get(ROTATE_ANNOTATION, "")))


class AcceptedTokens:
    """The `accepted` tokens of each EnsembleRouter's engine credential, as its Specialists copy them.
    A Secret is read when the router's status digest (lifecycle/credential.accepted_digest) differs
    from the one last read: once per rotation step, not once per Specialist pass."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], tuple[str, str]] = {}   # (namespace, router) -> (digest, text)

    async def read(self, kube: Kube, namespace: str, router: str, uid: str, digest: str | None) -> str | None:
        """The tokens, a line each; None while the router has no Secret of its own (not written yet,
        or a foreign object under its name: never copied)."""
        known = self._known.get((namespace, router))
        if digest is not None and known is not None and known[0] == digest:
            return known[1]
        name = engine_credential_secret_name(router)
        state = state_from_secret(ours(await kube.get("Secret", namespace, name), name, uid))
        if state is None:
            return None
        text = accepted_text(state)
        if accepted_digest(text) == digest:   # a status behind its Secret is read again next pass
            self._known[(namespace, router)] = (digest, text)
        return text
