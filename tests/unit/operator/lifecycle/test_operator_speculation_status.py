"""Specialist status.speculation pools the warm replicas' /v1/status speculation reports."""
from __future__ import annotations

from consort_operator.api.specialist import SpecialistStatus
from consort_operator.lifecycle.speculation import pooled


def test_pooled_acceptance_over_replicas():
    got = pooled([{"mode": "mtp", "state": "on", "drafter": "mtp", "draft_tokens": 30, "accepted_tokens": 12},
                  {"mode": "mtp", "state": "on", "drafter": "mtp", "draft_tokens": 10, "accepted_tokens": 8}])
    assert got == {"state": "on", "drafter": "mtp", "draftTokens": 40, "acceptedTokens": 20, "acceptanceRate": 0.5}
    SpecialistStatus.model_validate({"speculation": got})       # the CRD's status schema takes it


def test_a_fallback_replica_makes_the_pool_fallback_and_no_drafts_no_rate():
    got = pooled([{"state": "on", "drafter": "mtp", "draft_tokens": 0, "accepted_tokens": 0},
                  {"state": "fallback", "drafter": "ngram", "draft_tokens": 0, "accepted_tokens": 0}])
    assert got == {"state": "fallback", "drafter": "ngram", "draftTokens": 0, "acceptedTokens": 0}
    assert pooled([]) is None and pooled([{}]) is None
