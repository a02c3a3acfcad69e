"""The KV tier's bookkeeping: checksummed, identity-checked, byte-bounded LRU files, off on disk failure."""
from __future__ import annotations

import argparse
import os
import shutil

import pytest

from consort_engine.config import byte_size
from consort_engine.kv.events import KVEventLog
from consort_engine.kv.tier import SUFFIX, KVTier, layout_dir

ID = "model=abc dtype=float32 block=2x2x2x4x8 layout=tokens-first shard=0/1"


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def written(tier: KVTier, *items: tuple[bytes, bytes]) -> KVTier:
    for key, data in items:
        tier.save(key, data)
    assert tier.flush(5.0)
    return tier


def test_a_block_round_trips_and_a_missing_one_is_a_miss(tmp_path):
    tier = written(KVTier(str(tmp_path), 1 << 20, ID), (h(1), b"kv-bytes-1"))
    assert tier.load(h(1)) == (b"kv-bytes-1", b"")
    assert tier.load(h(2)) is None
    s = tier.stats()
    assert (s["kv_tier_hits"], s["kv_tier_misses"], s["kv_tier_blocks"]) == (1, 1, 1)
    assert not [p for p in (tmp_path / layout_dir(ID)).iterdir() if p.name.endswith(".tmp")]   # renamed into place


def test_a_corrupted_or_truncated_block_is_refused_and_deleted(tmp_path):
    tier = written(KVTier(str(tmp_path), 1 << 20, ID), (h(1), b"A" * 64), (h(2), b"B" * 64))
    d = tmp_path / layout_dir(ID)
    flipped = bytearray((d / (h(1).hex() + SUFFIX)).read_bytes())
    flipped[-10] ^= 0x01
    (d / (h(1).hex() + SUFFIX)).write_bytes(bytes(flipped))
    torn = (d / (h(2).hex() + SUFFIX)).read_bytes()
    (d / (h(2).hex() + SUFFIX)).write_bytes(torn[:-5])
    assert tier.load(h(1)) is None and tier.load(h(2)) is None
    assert tier.stats()["kv_tier_rejected"] == 2
    assert not (d / (h(1).hex() + SUFFIX)).exists() and not tier.holds(h(1))


def test_a_foreign_block_another_model_or_layout_is_refused(tmp_path):
    other = "model=abc dtype=bfloat16 block=2x2x2x4x8 layout=tokens-first shard=0/1"
    written(KVTier(str(tmp_path), 1 << 20, other), (h(7), b"C" * 32))
    mine = KVTier(str(tmp_path), 1 << 20, ID)
    assert mine.load(h(7)) is None                 # another layout's directory: never looked at
    shutil.copy(tmp_path / layout_dir(other) / (h(7).hex() + SUFFIX), tmp_path / layout_dir(ID))
    assert mine.load(h(7)) is None                 # copied in anyway: the header's identity refuses it
    (tmp_path / layout_dir(ID) / (h(8).hex() + SUFFIX)).write_bytes(
        (tmp_path / layout_dir(other) / (h(7).hex() + SUFFIX)).read_bytes().replace(b"bfloat16", b"float32"))
    assert mine.load(h(8)) is None                 # right identity, but the header names another block
    assert mine.stats()["kv_tier_rejected"] == 2


def test_a_hybrid_block_carries_its_state_under_the_same_checksum(tmp_path):
    tier = KVTier(str(tmp_path), 1 << 20, ID)
    tier.save(h(1), b"K" * 64, b"S" * 32)
    tier.save(h(2), b"K" * 64)                     # no state checkpoint at its end: K/V only
    assert tier.flush(5.0)
    assert tier.load(h(1)) == (b"K" * 64, b"S" * 32) and tier.load(h(2)) == (b"K" * 64, b"")
    assert tier.bytes == 64 + 32 + 64
    path = tmp_path / layout_dir(ID) / (h(1).hex() + SUFFIX)
    flipped = bytearray(path.read_bytes())
    flipped[-3] ^= 0x01                            # inside the state part
    path.write_bytes(bytes(flipped))
    assert tier.load(h(1)) is None and tier.stats()["kv_tier_rejected"] == 1 and not path.exists()


def test_the_byte_bound_drops_least_recently_used_blocks(tmp_path):
    events = KVEventLog()
    tier = written(KVTier(str(tmp_path), 300, ID, events), (h(1), b"1" * 100), (h(2), b"2" * 100), (h(3), b"3" * 100))
    assert tier.load(h(1)) is not None             # 1 is now the most recently used
    written(tier, (h(4), b"4" * 100))
    assert tier.bytes <= 300 and not tier.holds(h(2))
    assert tier.load(h(2)) is None and all(tier.load(h(i)) for i in (1, 3, 4))
    assert len(list((tmp_path / layout_dir(ID)).glob("*" + SUFFIX))) == 3
    assert {bytes.fromhex(x) for x in events.read(None, None)["snapshot"]["tier"]} == {h(1), h(3), h(4)}


def test_a_restart_adopts_the_directory_and_a_second_replica_reads_the_first_ones_blocks(tmp_path):
    written(KVTier(str(tmp_path), 1 << 20, ID), (h(1), b"x" * 10), (h(2), b"y" * 10))
    again = KVTier(str(tmp_path), 1 << 20, ID)
    assert again.holds(h(1)) and again.bytes > 0
    assert again.load(h(2)) == (b"y" * 10, b"")


def test_a_failing_disk_turns_the_tier_off_with_a_reason_and_an_event(tmp_path):
    events = KVEventLog()
    tier = written(KVTier(str(tmp_path), 1 << 20, ID, events), (h(1), b"z" * 10))
    shutil.rmtree(tmp_path / layout_dir(ID))       # the volume went away
    tier.save(h(2), b"w" * 10)
    tier.flush(5.0)
    assert not tier.enabled and "cannot write" in tier.stats()["kv_tier_disabled_reason"]
    assert tier.load(h(1)) is None
    assert events.read(None, None)["snapshot"]["tier"] == []
    tier.save(h(3), b"v")                          # ignored, no error


def test_a_slow_disk_turns_the_tier_off(tmp_path):
    tier = written(KVTier(str(tmp_path), 1 << 20, ID, slow_write_s=0.0), (h(1), b"s" * 10))
    assert not tier.enabled and "took" in tier.stats()["kv_tier_disabled_reason"]


def test_host_memory_tier_has_the_same_bound(tmp_path):
    tier = written(KVTier(None, 150, ID), (h(1), b"1" * 100), (h(2), b"2" * 100))
    assert tier.kind == "memory" and tier.load(h(2)) == (b"2" * 100, b"") and tier.load(h(1)) is None
    assert not os.listdir(tmp_path)


def test_tier_size_flag_takes_binary_suffixes_and_refuses_nonsense():
    assert (byte_size("4G"), byte_size("512M"), byte_size("1.5GiB"), byte_size("1000")) == (
        4 << 30, 512 << 20, 3 << 29, 1000)
    for bad in ("0", "x", "-1G", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_the_layout_identity_names_the_weight_quantization_and_both_dtypes(tmp_path):
    import json
    from types import SimpleNamespace

    import torch

    from consort_engine.model.kv_blocks import layout_identity

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    cache = torch.zeros(2, 2, 4, 16, 2, 8)
    ids = {q: layout_identity(SimpleNamespace(model=str(tmp_path), quantization=q), torch.float32, cache,
                              "cpu_kernel", 0, 1)
           for q in ("none", "int8", "w8a8")}
    assert len(set(ids.values())) == 3        # int8 weights compute other K/V: never each other's blocks
    config = SimpleNamespace(model=str(tmp_path), quantization="none")
    # the same pool element from other weights, and other pool elements from the same weights: all differ
    pools = {(w, c): layout_identity(config, w, cache.to(c), "cpu_kernel", 0, 1)
             for w, c in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
                          (torch.float32, torch.float8_e4m3fn))}
    assert len(set(pools.values())) == 5
    assert "dtype=bfloat16 kv=float8_e4m3fn " in pools[torch.bfloat16, torch.float8_e4m3fn]
