"""The CPU kernels prebuilt per x86-64 level (what the engine image ships): the level a CPU's flags
allow, and an engine pointed at a prebuilt directory loads the library for its level without
compiling anything."""
from __future__ import annotations

import ctypes
import os
import platform

import pytest

from consort_common.machine import cpu_model_and_flags
from consort_engine.model import cpu_kernels as ck

ZEN3 = set("fpu sse sse2 ssse3 sse4_1 sse4_2 cx16 lahf_lm popcnt avx avx2 bmi1 bmi2 f16c fma abm movbe "
           "xsave".split())


def test_the_highest_level_the_flags_allow():
    assert ck.cpu_level(ZEN3) == "x86-64-v3"
    assert ck.cpu_level(ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}) == "x86-64-v4"
    assert ck.cpu_level(ZEN3 | {"avx512f"}) == "x86-64-v3"        # AVX-512F alone is not v4
    assert ck.cpu_level(ZEN3 - {"fma"}) == "x86-64-v2"
    v4 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    assert ck.cpu_level(v4 | {"avx512_vnni", "avx512_bf16"}) == "x86-64-v4-vnni-bf16"   # Zen 4/5, Sapphire Rapids
    assert ck.cpu_level(v4 | {"avx512_vnni"}) == "x86-64-v4-vnni"                     # Cascade Lake
    assert ck.cpu_level(v4 | {"avx512_bf16"}) == "x86-64-v4"          # no such CPU: BF16 is built with VNNI
    assert ck.cpu_level(ZEN3 | {"avx_vnni"}) == "x86-64-v3-vnni"                      # Alder Lake
    assert ck.cpu_level({"fp", "asimd", "sve"}) is None            # an Arm CPU


def test_library_names_key_source_and_flags_and_the_cpu_for_native_only():
    assert ck.library_name("x86-64-v3") == ck.library_name("x86-64-v3", "clang", ZEN3)
    assert ck.library_name("x86-64-v3") != ck.library_name("x86-64-v4")
    assert ck.library_name("native", "cc", ZEN3) != ck.library_name("native", "cc", ZEN3 | {"avx512f"})


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the levels are x86-64's")
def test_an_engine_loads_the_prebuilt_library_for_its_level_and_compiles_nothing(tmp_path, monkeypatch):
    built = ck.prebuild(tmp_path / "prebuilt")
    assert sorted(p.name for p in built) == sorted(ck.library_name(level) for level in ck.LEVELS)
    monkeypatch.setenv("CONSORT_KERNELS_DIR", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("CONSORT_CACHE", str(tmp_path / "cache"))
    level = ck.cpu_level(cpu_model_and_flags()[1])
    so = ck.library_path()
    assert so == tmp_path / "prebuilt" / ck.library_name(level)
    assert not (tmp_path / "cache").exists()                        # nothing compiled for this machine
    lib = ctypes.CDLL(str(so))
    assert lib.rms_norm_f32 and lib.set_num_threads
    # The level's extensions are in it: the bf16 prefill kernel with AVX-512 BF16, w8a8's with VNNI.
    assert hasattr(lib, "prefill_attention_bf16") == level.endswith("bf16")
    assert hasattr(lib, "gemm_bf16") == level.endswith("bf16")
    assert hasattr(lib, "gemm_i8a8_f32") == ("vnni" in level)
    # Without the directory (or with another source's libraries in it) it compiles for this machine.
    monkeypatch.setenv("CONSORT_KERNELS_DIR", str(tmp_path / "empty"))
    assert ck.library_path() == tmp_path / "cache" / "kernels" / ck.library_name(
        "native", os.environ.get("CC", "cc"), cpu_model_and_flags()[1])
