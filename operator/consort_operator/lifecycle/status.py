"""The status keys the operator writes and the merge patch that writes only what changed.

Pure. A pass decides the whole status; what goes to the apiserver is the top-level merge patch from
the status the object holds to the decided one, over the keys this operator owns (an empty patch is
not sent). `patched` is the status the object holds once the patch lands: the next pass compares
against it even before the watch has delivered the operator's own write.
"""
from __future__ import annotations

from typing import Any

from ..api.router import EnsembleRouterStatus
from ..api.specialist import SpecialistStatus

SPECIALIST_STATUS_KEYS = frozenset(f.alias or n for n, f in SpecialistStatus.model_fields.items())
# breakerState is the router's own to write (kube_store.py in the router pods)
ROUTER_STATUS_KEYS = frozenset(f.alias or n for n, f in EnsembleRouterStatus.model_fields.items()) - {"breakerState"}
STATUS_KEYS = {"Specialist": SPECIALIST_STATUS_KEYS, "EnsembleRouter": ROUTER_STATUS_KEYS}


def merge_patch(old: dict[str, Any], new: dict[str, Any], owned_keys: frozenset[str]) -> dict[str, Any]:
    """Top-level merge patch from old to new over the keys this operator owns ({}: nothing to write)."""
    patch: dict[str, Any] = {}
    for k in owned_keys:
        if k in new and new[k] is not None:
            if old.get(k) != new[k]:
                patch[k] = new[k]
        elif old.get(k) is not None:
            patch[k] = None
    return patch


def patched(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`old` with a top-level merge patch applied (None deletes the key)."""
    out = {k: v for k, v in old.items() if k not in patch}
    out.update({k: v for k, v in patch.items() if v is not None})
    return out
