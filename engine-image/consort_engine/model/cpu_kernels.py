"""The CPU kernels (csrc/cpu_kernels.c): compiled once per machine with the system C compiler
(a second or two, cached under ~/.cache/consort/kernels keyed by source and flags) and called
through ctypes, which releases the GIL. None when no compiler is available: callers fall back
to torch ops. CONSORT_CPU_KERNEL=0 disables them.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp first: the kernels' libgomp.so.1 resolves to it)

SRC = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# Reassociation lets the compiler vectorise the reductions; not -ffast-math, whose crtfastmath
# would switch the whole process to flush-to-zero when the library loads.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]

P, I, L, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {   # name (per dtype suffix) -> (argtypes, restype)
    "paged_attention": ([P, L, P, P, P, L, P, I, P, P, I, I, I, I, I, L, L, L, F32], I),
    "prefill_attention": ([P, L, P, P, P, L, P, I, P, P, I, I, I, I, I, L, L, L, F32], I),   # f32, AVX-512 builds
    "store_kv": ([P, L, P, L, P, P, P, I, I, I, I, L, L, L], None),
    "rms_norm": ([P, L, P, L, P, I, I, I, F32], None),
    "add_rms_norm": ([P, P, P, P, I, I, F32], None),
    "rope": ([P, L, I, I, I, P, P, P], None),
    "silu_mul": ([P, P, I, I], None),
    "gemm": ([P, L, L, L, P, L, P, L, P], I),             # AVX2 + FMA builds only (see the .c)
    "gemm_pack": ([P, L, L, P], None),
    "gemm_packed_floats": ([L, L], L),
}

_lib: ctypes.CDLL | None | bool = False   # False = not tried yet


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), os.uname().machine)
    except OSError:
        return os.uname().machine


def _build() -> ctypes.CDLL | None:
    if os.environ.get("CONSORT_CPU_KERNEL", "1") == "0" or not SRC.exists():
        return None
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(SRC.read_bytes() + " ".join([cc, *FLAGS]).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]   # -march=native: per CPU model
    name = f"cpu_kernels-{key}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"
    cache = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort")) / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:           # read-only home (a locked-down pod): build in a private temp dir
        cache = Path(tempfile.mkdtemp(prefix="consort-kernels-"))
    so = cache / name
    if not so.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / so.name
            try:
                subprocess.run([cc, *FLAGS, "-o", str(out), str(SRC), "-lm"], check=True,
                               capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return None
            os.replace(out, so)     # atomic: concurrent engines never load a half-written file
    lib = ctypes.CDLL(str(so))
    for name, (argtypes, restype) in SIGNATURES.items():
        for suffix in ("f32", "bf16", "f32_bf16kv"):
            fn = getattr(lib, f"{name}_{suffix}", None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, restype
    lib.set_num_threads.argtypes, lib.set_num_threads.restype = [I], None
    lib.team_size.argtypes, lib.team_size.restype = [], I
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


def kernel(name: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
    """The compiled function for this activation dtype (float32 or bfloat16) and, for the
    attention kernels, the KV cache dtype (float32 activations over a bfloat16 cache included)."""
    suffix = "f32" if dtype == torch.float32 else "bf16"
    if kv_dtype is not None and kv_dtype != dtype:
        suffix = "f32_bf16kv"
    return getattr(cpu_kernels(), f"{name}_{suffix}")
