"""The KV block hash: the one definition of a prefix-cache block's identity.

The engine's block manager keys its prefix cache with it and publishes it in its block events
(kv/events.py); a router that scores prefixes computes the same function over the same token ids.
Pure Python, standard library only (no torch), so both sides import the same code.

    block_hash(parent, token_ids, model, adapter, salt) =
        BLAKE2b-128( parent || extra_key(model, adapter, salt) || token_ids as little-endian uint32 )

`parent` is the previous block's hash, ROOT (16 zero bytes) for a chain's first block. The extra
keys are part of every block: two models, two adapters or two cache salts (tenants) never share a
hash. A sequence's blocks are its token ids cut into `block_size` pieces; only full blocks are
hashed. The block size is not hashed: it only decides where the cuts are, so a router that cuts
elsewhere finds no match (never a wrong one). No seed, no Python `hash()`: the value is the same
in every process, on every machine, across restarts.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from functools import lru_cache

HASH_VERSION = "consort-kv-block-v1"   # changes whenever the definition below changes
DIGEST_BYTES = 16
ROOT = bytes(DIGEST_BYTES)             # the parent of a chain's first block
_NONE = b"\xff\xff\xff\xff"            # an absent key (None), distinct from an empty string


@lru_cache(maxsize=4096)
def extra_key(model: str, adapter: str | None, salt: str | None) -> bytes:
    """The bytes every block of a (model, adapter, salt) chain carries: each field length-prefixed
    (so ("ab", "c") and ("a", "bc") differ), after the definition's version."""
    out = bytearray()
    for field in (HASH_VERSION, model, adapter, salt):
        if field is None:
            out += _NONE
        else:
            data = field.encode()
            out += struct.pack("<I", len(data)) + data
    return bytes(out)


def block_hash(parent: bytes, token_ids: Sequence[int], model: str, adapter: str | None = None,
               salt: str | None = None) -> bytes:
    """The hash of one full block, chained over its parent's hash (ROOT for the first block)."""
    return hashlib.blake2b(parent + extra_key(model, adapter, salt) + _packer(len(token_ids)).pack(*token_ids),
                           digest_size=DIGEST_BYTES).digest()


@lru_cache(maxsize=64)
def _packer(n: int) -> struct.Struct:
    """n token ids as little-endian uint32 (a compiled Struct: packing is most of the hash's cost)."""
    return struct.Struct(f"<{n}I")


def prefix_hashes(token_ids: Sequence[int], block_size: int, model: str, adapter: str | None = None,
                  salt: str | None = None) -> list[bytes]:
    """The hashes of every full block of token_ids, first block first (what a router looks up)."""
    hashes: list[bytes] = []
    parent = ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], model, adapter, salt)
        hashes.append(parent)
    return hashes


def prefix_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The `salt` of a request's blocks: its tenant (the router's x-consort-tenant header) and, within
    the tenant, its `cache_salt`. None (the shared cache) only when neither is given. The engine salts
    its cache with it and a router computes the same value to look the request's blocks up."""
    if tenant is None and cache_salt is None:
        return None
    return hashlib.sha256(json.dumps([tenant, cache_salt]).encode()).hexdigest()
