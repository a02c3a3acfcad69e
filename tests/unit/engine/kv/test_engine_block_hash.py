"""The one definition of the KV block hash: deterministic across processes, chained, keyed."""
from __future__ import annotations

import subprocess
import sys

from consort_common.block_hash import ROOT, block_hash, prefix_hashes
from consort_engine.kv.block_manager import BlockManager
from consort_engine.kv.sequence import SamplingParams, Sequence

BLOCK = list(range(100, 116))


def test_same_inputs_same_hash_in_another_process():
    """No seed, no Python hash(): a fresh interpreter (another PYTHONHASHSEED) computes the same bytes."""
    here = block_hash(ROOT, BLOCK, "spec", "lora-a", "tenant").hex()
    code = ("from consort_common.block_hash import ROOT, block_hash;"
            f"print(block_hash(ROOT, {BLOCK!r}, 'spec', 'lora-a', 'tenant').hex())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PYTHONPATH": ":".join(sys.path)}).stdout.strip()
    assert here == there and len(bytes.fromhex(here)) == 16


def test_the_parent_is_chained_in():
    a = block_hash(ROOT, BLOCK, "spec")
    assert block_hash(a, BLOCK, "spec") != block_hash(ROOT, BLOCK, "spec")
    assert block_hash(a, BLOCK, "spec") != block_hash(block_hash(ROOT, [1] * 16, "spec"), BLOCK, "spec")


def test_every_extra_key_changes_the_hash():
    base = block_hash(ROOT, BLOCK, "spec", None, None)
    others = [block_hash(ROOT, BLOCK, "other", None, None), block_hash(ROOT, BLOCK, "spec", "lora", None),
              block_hash(ROOT, BLOCK, "spec", None, "tenant"), block_hash(ROOT, BLOCK, "spec", "", None),
              block_hash(ROOT, BLOCK, "spec", None, ""), block_hash(ROOT, BLOCK[:-1] + [999], "spec")]
    assert len({base, *others}) == 1 + len(others)
    # fields are length-prefixed: moving a character from one key to the next is another key
    assert block_hash(ROOT, BLOCK, "ab", "c") != block_hash(ROOT, BLOCK, "a", "bc")


def test_prefix_hashes_are_the_block_managers_keys():
    """What a router computes from token ids is what the engine registers (same function, same cuts)."""
    bm = BlockManager(16, 4, namespace="spec")
    seq = Sequence(list(range(1, 12)), SamplingParams(), cache_salt="t1")
    bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    expected = prefix_hashes(seq.token_ids, 4, "spec", None, "t1")
    assert len(expected) == 2
    assert bm._seq_hashes[seq.seq_id] == expected
