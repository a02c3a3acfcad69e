"""Reading an EnsembleRouter's Secrets for its reconcile pass (lifecycle/credential.py decides what they
should hold; the handler writes them with the other children), and remembering its engine credential
for the operator's own probes of the engines (probe.py)."""
from __future__ import annotations

from typing import Any

from .kube import Kube
from .lifecycle.credential import ROTATE_ANNOTATION, RouterSecrets, ours, state_from_secret
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
