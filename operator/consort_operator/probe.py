"""Engine probing: GET /ready (and /v1/status: adapters, SLO attainment) through the pod-address resolver.

/v1/status needs the engine credential: the prober presents the `current` token of an EnsembleRouter
that selects the Specialist (the engines accept it), as the router reconciles last read it."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from .lifecycle.warmup import ProbeResult
from .metrics import PROBES


class Prober:
    def __init__(self, timeout: float = 1.5, concurrency: int = 32):
        self.timeout = timeout
        self._sem = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None
        self.tokens: dict[tuple[str, str], str] = {}   # (namespace, EnsembleRouter) -> its current token

    def token(self, namespace: str, routers: tuple[str, ...]) -> str | None:
        """A credential the engines of a Specialist selected by `routers` accept (None: none known yet)."""
        return next((self.tokens[(namespace, r)] for r in sorted(routers) if (namespace, r) in self.tokens), None)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=64, force_close=True))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def probe(self, address: str, token: str | None = None) -> ProbeResult:
        base = f"http://{address}"
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        async with self._sem:
            try:
                async with self.session.get(f"{base}/ready") as resp:
                    body: Any = await resp.json(content_type=None) if resp.content_length != 0 else {}
                    warm = resp.status == 200
                reason = "" if warm else str((body or {}).get("reason") or f"HTTP {resp.status}")
                adapters: dict[str, str] = {}
                errors: dict[str, str] = {}
                slo: dict[str, Any] = {}
                spec: dict[str, Any] = {}
                idle_s: float | None = None
                async with self.session.get(f"{base}/v1/status", headers=auth) as resp:
                    if token and resp.status in (401, 403) and warm:
                        # Its router would be refused too: not warm until the kubelet brings the
                        # Specialist's credentials Secret to the pod (its sync period, about a minute).
                        warm, reason = False, "the engine does not accept its router's credential yet"
                    elif resp.status == 200:
                        st = await resp.json(content_type=None)
                        adapters = {str(k): str(v) for k, v in (st.get("adapters") or {}).items()}
                        errors = {str(k): str(v)[:300] for k, v in (st.get("adapter_errors") or {}).items()}
                        slo = st.get("slo") if isinstance(st.get("slo"), dict) else {}
                        spec = st.get("speculation") if isinstance(st.get("speculation"), dict) else {}
                        idle = st.get("idle_s")
                        idle_s = float(idle) if isinstance(idle, (int, float)) and not isinstance(idle, bool) else None
                PROBES.labels("warm" if warm else "cold").inc()
                return ProbeResult(reachable=True, warm=warm, reason=reason, adapters=adapters, slo=slo,
                                   speculation=spec, adapter_errors=errors, idle_s=idle_s)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
                PROBES.labels("unreachable").inc()
                return ProbeResult(reachable=False, reason=f"{type(e).__name__}: {e}"[:200])
