"""Pure builders for the Secrets an EnsembleRouter owns and how pods mount them:

- `<router>-engine-credential`: the engine credential (lifecycle/credential.py decides its content).
  The router pods mount its `current`.
- `<specialist>-engine-credentials`, owned by the Specialist: the `accepted` tokens of every
  EnsembleRouter that selects it, one key (and file) per EnsembleRouter, mounted as one directory
  into its engine pods (`consort engine --credential-file DIR`). One Secret whose keys change, not one
  volume source per router: adding or removing an EnsembleRouter changes no pod template (no
  rollout); the kubelet brings the new files to the running engines.
- `<router>-api-keys`: API keys generated when the EnsembleRouter names no `auth.apiKeysSecretRef`
  (one tenant, `default`); written once, then left to the user to edit.
"""
from __future__ import annotations

import base64
from typing import Any

from .common import object_meta, stamp_hash

ENGINE_CREDENTIALS_DIR = "/etc/consort/engine-credentials"   # engine pods: one file per EnsembleRouter
ROUTER_CREDENTIAL_DIR = "/etc/consort/engine-credential"     # router pods: `current`
ROUTER_CREDENTIAL_FILE = f"{ROUTER_CREDENTIAL_DIR}/current"
API_KEYS_KEY = "keys"
GENERATED_TENANT = "default"


def engine_credential_secret_name(router: str) -> str:
    return f"{router}-engine-credential"


def engine_credentials_secret_name(specialist: str) -> str:
    return f"{specialist}-engine-credentials"


def api_keys_secret_name(router: str) -> str:
    return f"{router}-api-keys"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def secret(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any], data_b64: dict[str, str],
           annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return stamp_hash({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(name, namespace, labels, owner, annotations),
        "type": "Opaque",
        "data": dict(sorted(data_b64.items())),
    })


def generated_keys(key: str) -> str:
    """A new keys file (base64, as a Secret holds it): one tenant."""
    return b64(f"# name: key (one tenant a line; edit freely, the router re-reads this)\n{GENERATED_TENANT}: {key}\n")


def router_credential_volume(router: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router pod's volume and mount: `current`, the token it presents (a whole-directory mount,
    never subPath, so a rotation reaches the running router)."""
    volume = {"name": "engine-credential",
              "secret": {"secretName": engine_credential_secret_name(router),
                         "items": [{"key": "current", "path": "current"}]}}
    return volume, {"name": "engine-credential", "mountPath": ROUTER_CREDENTIAL_DIR, "readOnly": True}


def engine_credentials_secret(specialist: str, namespace: str, labels: dict[str, str], owner: dict[str, Any],
                              accepted: dict[str, str]) -> dict[str, Any]:
    """What the engines of `specialist` accept: {EnsembleRouter name: its `accepted` tokens, a line each}."""
    return secret(engine_credentials_secret_name(specialist), namespace, labels, owner,
                  {router: b64(text) for router, text in accepted.items()})


def engine_credentials_volume(specialist: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine pod's volume and mount: the Specialist's credentials Secret, a file per EnsembleRouter.
    No EnsembleRouter selecting it: an empty directory, which the engine treats as closed (its probes
    only), never open. Optional, so the pods start before the operator's first write of the Secret."""
    volume = {"name": "engine-credentials",
              "secret": {"secretName": engine_credentials_secret_name(specialist), "optional": True}}
    return volume, {"name": "engine-credentials", "mountPath": ENGINE_CREDENTIALS_DIR, "readOnly": True}
