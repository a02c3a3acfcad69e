"""The CPU kernels (csrc/: one library from its C files), called through ctypes, which releases the GIL.

Where the library comes from, first found:
1. a prebuilt one for the CPU's level in CONSORT_KERNELS_DIR (LEVELS: x86-64 v4 = AVX-512, with VNNI and
   BF16 or VNNI alone; v3 = AVX2 + FMA, with AVX-VNNI or without; v2): the engine image builds them all
   (`python -m consort_engine.model.cpu_kernels --prebuild DIR`),
   so a pod's first start loads one instead of compiling (seconds of a scale-from-zero);
2. one compiled for this machine (-march=native) with the system C compiler, cached under
   $CONSORT_CACHE/kernels keyed by source, flags and CPU (a second or two, once per machine).
None when neither works (no compiler): callers fall back to torch ops. CONSORT_CPU_KERNEL=0
disables them.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch  # noqa: F401  (loads torch's libgomp first: the kernels' libgomp.so.1 resolves to it)

from consort_common.machine import cpu_model_and_flags

KERNEL_FILES = sorted(Path(__file__).with_name("csrc").glob("*.[ch]"))
SOURCES = [p for p in KERNEL_FILES if p.suffix == ".c"]   # one job each; common.h is what they share
# Reassociation lets the compiler vectorise the reductions; not -ffast-math, whose crtfastmath
# would switch the whole process to flush-to-zero when the library loads.
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]

# The libraries a machine or the engine image builds: gcc's x86-64 microarchitecture levels, and the v3 /
# v4 levels with the dot-product extensions some kernels are written for (VNNI: the int8 kernels'
# vpdpwssd and gemm_i8a8.c's vpdpbusd; AVX-512 BF16: prefill_attention_bf16.c and gemm_bf16.c). Each: its compiler flags
# and the /proc/cpuinfo flags it assumes (lzcnt shows as abm), highest first. The kernels' own paths need
# AVX-512F (v4) or AVX2 + FMA (v3).
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


class Level(NamedTuple):
    march: tuple[str, ...]        # compiler flags
    needs: frozenset[str]         # /proc/cpuinfo flags


LEVELS = {
    # Zen 4/5, Cooper Lake, Sapphire Rapids and later
    "x86-64-v4-vnni-bf16": Level(("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
                                 _V4 | {"avx512_vnni", "avx512_bf16"}),
    "x86-64-v4-vnni": Level(("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),   # Cascade, Ice Lake
    "x86-64-v4": Level(("-march=x86-64-v4",), _V4),
    "x86-64-v3-vnni": Level(("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}),   # Alder Lake, Sierra Forest
    "x86-64-v3": Level(("-march=x86-64-v3",), _V3),
    "x86-64-v2": Level(("-march=x86-64-v2",), _V2),
}

def march(level: str) -> tuple[str, ...]:
    """The compiler flags of a LEVELS name, or of "native" (this machine's CPU)."""
    return ("-march=native",) if level == "native" else LEVELS[level].march


P, I, L, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {   # name (per dtype suffix) -> (argtypes, restype)
    "paged_attention": ([P, L, P, P, P, L, P, I, P, P, I, I, I, I, I, L, L, L, F32], I),
    # AVX2 + FMA and AVX-512 builds; bf16 (queries and pool) where AVX-512 BF16 is built in
    "prefill_attention": ([P, L, P, P, P, L, P, I, P, P, I, I, I, I, I, L, L, L, F32], I),
    "store_kv": ([P, L, P, L, P, P, P, I, I, I, I, L, L, L], None),
    "rms_norm": ([P, L, P, L, P, I, I, I, F32], None),
    "add_rms_norm": ([P, P, P, P, I, I, F32], None),
    "rope": ([P, L, I, I, I, I, P, P, P], None),
    "silu_mul": ([P, P, I, I], None),
    "gated_rms_norm": ([P, P, L, P, P, I, I, I, F32], None),
    "argmax_rows": ([P, L, I, L, P], None),
    "lora_add": ([P, L, I, I, P, I, P, I, P, L], I),        # lora.c
    "lora_jobs": ([P, I], I),
    "mamba_step": ([P, L, P, L, P, P, P, I, I, P, L, P, L, P, P, P, P, P, L, I, I, I, I, I, I], I),
    "mamba_time_steps": ([P, L, P, P, L, I, I], None),
    "mamba_scan": ([P, L, P, L, P, P, P, I, P, P, P, I, P, L, P, L, P, P, F32, F32, P, L, I, I, I, I], None),
    "mamba_conv": ([P, L, P, P, P, I, P, P, P, I, P, L, P, L, P, P, P, L, I, I], None),
    "gemm": ([P, L, L, L, P, L, P, L, P], I),             # f32: AVX2 + FMA builds; bf16: AVX-512 BF16 ones
    "gemm_pack": ([P, L, L, P], None),
    "gemm_packed_floats": ([L, L], L),
    "gemm_packed_bytes": ([L, L], L),                     # bf16 (gemm_bf16.c)
    "gemm_i8w": ([P, L, L, L, P, P, L, P, L, P, L, P], I),   # int8 weights, AVX2 + FMA builds (gemm_i8w.c)
    "gemm_pack_i8w": ([P, L, L, P], None),
    "gemm_packed_bytes_i8w": ([L, L], L),
    "gemm_i8a8": ([P, L, L, L, P, P, L, L, P, L, P], I),    # int8 x int8, VNNI builds (gemm_i8a8.c)
    "gemm_pack_i8a8": ([P, L, L, P], None),
    "gemm_packed_bytes_i8a8": ([L, L], L),
}

# The functions' dtype suffixes (kernel_suffix): activations, and where it differs the K/V pool's.
SUFFIXES = ("f32", "bf16", "f32_bf16kv", "f32_fp8kv", "bf16_fp8kv")

_lib: ctypes.CDLL | None | bool = False   # False = not tried yet


def cpu_level(flags: set[str]) -> str | None:
    """The highest level (LEVELS) a CPU with these flags runs (None: not x86-64, or below v2)."""
    return next(iter(runnable_levels(flags)), None)


def runnable_levels(flags: set[str]) -> list[str]:
    """Every level (LEVELS) a CPU with these flags runs, highest first (tests check each build)."""
    return [name for name, level in LEVELS.items() if level.needs <= flags]


def library_name(level: str, cc: str = "", flags: set[str] = frozenset()) -> str:
    """File name of the library built for `level` (a LEVELS name, or "native"), keyed by source and
    compiler flags; for native by the compiler and the CPU too (a cache directory may be shared by machines)."""
    native = f"{cc} {' '.join(sorted(flags))}" if level == "native" else ""
    text = b"".join(p.name.encode() + p.read_bytes() for p in KERNEL_FILES)
    key = hashlib.sha256(text + " ".join([*march(level), *FLAGS, native]).encode()).hexdigest()[:16]
    return f"cpu_kernels-{level}-{key}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"


def compile_sources(out: Path, level: str, cc: str = "cc", sources: list[Path] = SOURCES) -> None:
    """Compile `sources` (default: every kernel) for `level` into the library `out`; raises
    subprocess.CalledProcessError (the compiler's messages in its stderr) when the compiler fails. Tests
    and hack/ scripts build single kernels with it for each level."""
    subprocess.run([cc, *march(level), *FLAGS, "-o", str(out), *map(str, sources), "-lm"], check=True,
                   capture_output=True, text=True, timeout=300)


def compile_library(so: Path, level: str, cc: str) -> bool:
    """Compile the kernels for `level` into `so` (atomically: concurrent engines never load a half-written file)."""
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        out = Path(tmp) / so.name
        try:
            compile_sources(out, level, cc)
        except (OSError, subprocess.SubprocessError):
            return False
        os.replace(out, so)
    return True


def prebuild(out_dir: Path, cc: str = "cc") -> list[Path]:
    """One library per level (LEVELS) into `out_dir` (the engine image's build step); none on other
    architectures, whose engines compile for their machine at first start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    built: list[Path] = []
    if platform.machine() not in ("x86_64", "AMD64"):
        return built
    for level in LEVELS:
        so = out_dir / library_name(level)
        if not compile_library(so, level, cc):
            raise RuntimeError(f"{cc} could not build the CPU kernels for {level}")
        built.append(so)
    return built


def library_path() -> Path | None:
    """The library to load: a prebuilt one for this CPU's level, else one compiled for this machine."""
    cc = os.environ.get("CC", "cc")
    flags = cpu_model_and_flags()[1]
    prebuilt, level = os.environ.get("CONSORT_KERNELS_DIR"), cpu_level(flags)
    if prebuilt and level and (so := Path(prebuilt) / library_name(level)).is_file():
        return so
    cache = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort")) / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:           # read-only home (a locked-down pod): build in a private temp dir
        cache = Path(tempfile.mkdtemp(prefix="consort-kernels-"))
    so = cache / library_name("native", cc, flags)
    return so if so.exists() or compile_library(so, "native", cc) else None


def _build() -> ctypes.CDLL | None:
    if os.environ.get("CONSORT_CPU_KERNEL", "1") == "0" or not SOURCES:
        return None
    so = library_path()
    return None if so is None else load_library(so)


def load_library(so: Path) -> ctypes.CDLL:
    """A kernels library with its functions' C signatures set and its team at torch's thread count."""
    lib = ctypes.CDLL(str(so))
    for name, (argtypes, restype) in SIGNATURES.items():
        for suffix in SUFFIXES:
            fn = getattr(lib, f"{name}_{suffix}", None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, restype
    lib.set_num_threads.argtypes, lib.set_num_threads.restype = [I], None
    lib.team_size.argtypes, lib.team_size.restype = [], I
    if hasattr(lib, "decoder_layers"):         # models/fused_layers.py (a library of some kernels lacks it)
        for fn in (lib.decoder_layers, lib.commit_windows):
            fn.argtypes, fn.restype = [P, P, I, P], I
    lib.set_num_threads(torch.get_num_threads())
    return lib


def cpu_kernels() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = _build()
    return _lib


def set_threads(n: int) -> None:
    """torch's pool and the kernels' team: n threads each. The kernels keep their own team size (a
    library built later reads torch's count at load) because OpenMP's default is per calling thread,
    and the engine's loop thread, which calls them, never saw torch.set_num_threads."""
    torch.set_num_threads(n)
    if _lib:
        _lib.set_num_threads(n)


_resolved: dict[tuple, object] = {}   # (library, name, dtype, kv dtype) -> its function


def kernel_suffix(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    """The C function suffix (SUFFIXES) for this activation dtype (float32 or bfloat16) and, for the
    attention kernels and the K/V store, the pool dtype: the activations' own, bfloat16 under float32
    activations (f32_bf16kv), or float8_e4m3fn under either (f32_fp8kv, bf16_fp8kv)."""
    act = "f32" if dtype == torch.float32 else "bf16"
    if kv_dtype == torch.float8_e4m3fn:
        return f"{act}_fp8kv"
    if kv_dtype is not None and kv_dtype != dtype:
        return "f32_bf16kv"
    return act


def kernel(name: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
    """The compiled function for this activation dtype and pool dtype (kernel_suffix). AttributeError
    where the library does not build it. Resolved once: layers ask ~50 times a step."""
    lib = cpu_kernels()
    key = (lib, name, dtype, kv_dtype)
    fn = _resolved.get(key)
    if fn is None:
        fn = _resolved[key] = getattr(lib, f"{name}_{kernel_suffix(dtype, kv_dtype)}")
    return fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m consort_engine.model.cpu_kernels",
                                 description="Build the CPU kernels for every x86-64 level (the engine image's step).")
    ap.add_argument("--prebuild", type=Path, required=True, metavar="DIR", help="where the libraries go")
    args = ap.parse_args(argv)
    for so in prebuild(args.prebuild):
        print(f"cpu_kernels: built {so}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
