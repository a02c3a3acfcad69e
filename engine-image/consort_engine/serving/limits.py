"""Request limits: every list, number and string a request hands the engine is bounded by these,
before any work starts (DESIGN.md section 8; docs/security.md "Request limits" gives each one's reason).
A value outside them is a typed 400 naming the field; none may raise inside the engine's step, where a
failure ends every request in flight on the replica."""
from __future__ import annotations

import re

MAX_LOGPROBS = 20              # logprobs / top_logprobs / prompt_logprobs (vLLM's default max_logprobs)
MAX_CHOICES = 64               # prompts x n (or best_of) in one request
MAX_STOP_STRINGS = 16          # `stop`: OpenAI allows 4, vLLM any number; 16 leaves room for eval harnesses
MAX_STOP_CHARS = 256           # per stop string: up to 255 characters of output are held back while they may start one
MAX_STOP_TOKEN_IDS = 1024      # `stop_token_ids` (vLLM: unbounded): a model has a few, a class of tokens hundreds
MAX_LOGIT_BIAS = 300           # `logit_bias` entries, OpenAI's limit
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)        # a signed 64-bit seed, as vLLM's OpenAI server takes it
PRIORITY_RANGE = (-1000, 1000)                  # the router's shadow copies run at -1000 (its lowest)
MAX_DEADLINE_MS = 24 * 3600 * 1000              # a day: longer deadlines mean nothing, bigger numbers overflow
MAX_CACHE_SALT_CHARS = 256     # vLLM's `cache_salt`: 43 base64 characters are 256 bits; more only costs hashing
MIN_TEMPERATURE = 0.01         # vLLM's floor: 0 < t < 0.01 runs at 0.01 (smaller divides logits into inf / NaN)
REPETITION_PENALTY_RANGE = (0.01, 100.0)        # vLLM: any > 0; beyond these a seen token's fate is sealed anyway,
                                                # and 1e-300 turned logits into inf, then NaN (a failed step)
MAX_GUIDED_CHARS = 64 * 1024   # a schema / regex / grammar / choice list as text: xgrammar compile time grows
                               # superlinearly (a 25 KB schema ~0.5 s, 100 KB ~34 s on the 2-core dev box)
MAX_CONCURRENT_COMPILES = 2    # grammar compiles at once, each on a worker thread; more wait for a slot
GUIDED_COMPILE_TIMEOUT_S = 10.0  # a compile (slot wait included) answered later than this is a typed error
# top_k: -1 or 0 (off) or 1..vocab; above the vocabulary it is off, as vLLM clamps it (prepare.check_vocab).

ADAPTER_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")   # a DNS label, as the CRD requires
