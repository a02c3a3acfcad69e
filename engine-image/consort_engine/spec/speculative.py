"""Self-drafting speculative decoding: n-gram prompt lookup.

A sequence's next tokens are often a copy of something already in its context (code echoes
identifiers, signatures, includes). The proposer finds the most recent earlier occurrence of the
context's last n tokens (n from `max_n` down to `min_n`) and proposes the k tokens that followed
it. The scheduler runs them as one verify window (1 + k query rows); the target model's greedy
choice at each row accepts the longest matching prefix plus one token of its own, so greedy output
is exactly what one-token decoding gives, in fewer steps. Sampled requests (temperature > 0) use
typical acceptance instead (`typical_accepted`, tau = 0.1 by default): a bounded-latency heuristic
for structured code, not the identical-distribution guarantee of rejection sampling.

The search runs in C: token ids are packed into bytes and `bytes.rfind` scans for the suffix
(a hit must sit on a token boundary), so there is no per-token Python loop.
"""
from __future__ import annotations

from array import array

import torch

TOKEN_BYTES = 4


def propose_ngram(token_ids: list[int], k: int, max_n: int = 3, min_n: int = 1,
                  packed: bytearray | None = None) -> list[int]:
    """Up to k draft tokens following the latest earlier occurrence of the last n tokens.

    `packed` is the caller's running byte copy of token_ids (a sequence keeps one): only tokens
    added since the last call are packed, not the whole context every step."""
    total = len(token_ids)
    if k <= 0 or total < min_n + 1:
        return []
    if packed is None:
        packed = bytearray()
    have = len(packed) // TOKEN_BYTES
    if have > total:                    # the tokens were cut back: pack afresh
        del packed[:]
        have = 0
    if have < total:
        packed += array("i", token_ids[have:]).tobytes()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = packed[(total - n) * TOKEN_BYTES:]
        limit = (total - 1) * TOKEN_BYTES      # a match ends before the last token: one follows it
        while (at := packed.rfind(suffix, 0, limit)) >= 0:
            if at % TOKEN_BYTES == 0:
                start = at // TOKEN_BYTES + n
                return list(token_ids[start:start + k])
            limit = at + len(suffix) - 1       # a byte-misaligned hit: look further left
    return []


def typical_threshold(probs: torch.Tensor, tau: float) -> torch.Tensor:
    """Typical acceptance (Medusa): a draft token stands when the target gives it probability at
    least min(tau, sqrt(tau) * exp(-entropy)) under the request's temperature: strict where the
    model is sure, lenient where it is spread out. probs [rows, vocab] -> [rows]."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.clamp(tau ** 0.5 * torch.exp(-entropy), max=tau)


def typical_accepted(probs: torch.Tensor, draft: list[int], tau: float) -> int:
    """How many leading draft tokens pass the typical-acceptance test (probs: one row per draft)."""
    if not draft:
        return 0
    idx = torch.tensor(draft, dtype=torch.int64, device=probs.device)
    ok = (probs[: len(draft)].gather(1, idx[:, None])[:, 0] >= typical_threshold(probs[: len(draft)], tau)).tolist()
    return next((i for i, good in enumerate(ok) if not good), len(draft))
