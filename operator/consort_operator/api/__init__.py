"""The Consort API (consort.dev/v1alpha1): pydantic models that are the one source of the CRDs."""
from .base import API_VERSION, GROUP, VERSION
from .router import EnsembleRouterSpec, EnsembleRouterStatus
from .specialist import SpecialistSpec, SpecialistStatus

__all__ = ["API_VERSION", "GROUP", "VERSION", "SpecialistSpec", "SpecialistStatus",
           "EnsembleRouterSpec", "EnsembleRouterStatus"]
