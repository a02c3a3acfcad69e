"""Label selectors between EnsembleRouters and Specialists, one way for both directions.

Pure, over the entries Kopf's indexes hold (raw dicts: the indexes keep no parsed models).
"""
from __future__ import annotations

from typing import Any, Iterable

from ..api.base import LabelSelector
from .router import SelectedSpecialist


def selects(selector: dict[str, Any] | None, labels: dict[str, str] | None) -> bool:
    """Whether a specialistSelector (raw, as in the spec) picks an object with these labels."""
    return LabelSelector.model_validate(selector or {}).matches(labels)


def selecting_routers(routers: Iterable[dict[str, Any]], labels: dict[str, str]) -> tuple[dict[str, Any], ...]:
    """The EnsembleRouters (router index entries: name, selector, breakerState) whose selector picks
    these labels."""
    return tuple(r for r in routers if selects(r["selector"], labels))


def selected_specialists(specialists: Iterable[dict[str, Any]], selector: dict[str, Any] | None
                         ) -> tuple[SelectedSpecialist, ...]:
    """The Specialists (specialist index entries) a selector picks, sorted by name."""
    chosen = LabelSelector.model_validate(selector or {})
    return tuple(SelectedSpecialist(s["name"], s["spec"], s["phase"], s["warmReplicas"], s["breaker"], s["laneAdapter"])
                 for s in sorted(specialists, key=lambda s: s["name"]) if chosen.matches(s["labels"]))
