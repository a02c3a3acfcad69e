"""The C++ verifier with the real g++: valid passes, invalid fails, limits cut runaway compiles, and
includes outside the standard headers can neither read files nor hang."""
from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest

from consort_router.config import VerifierConfig
from consort_router.verifier import Verifier, extract_cpp_blocks, screen

pytestmark = pytest.mark.timeout(120)

VALID = """#include <vector>
#include <algorithm>
#include <ranges>
template <typename T> concept Sortable = requires(T t) { std::ranges::sort(t); };
int main() { std::vector<int> v{3, 1, 2}; std::ranges::sort(v); return v.front(); }
"""
INVALID = "int main() { return undeclared_name; }\n"


def test_gxx_is_installed():
    assert shutil.which("g++"), "the verifier needs g++ (the router image installs it)"


def verifier(**kw) -> Verifier:
    return Verifier(VerifierConfig(**kw))


def md(code: str, tag: str = "cpp") -> str:
    return f"Here you go:\n```{tag}\n{code}```\nDone."


def test_extract_blocks():
    text = md(VALID) + "\n```python\nprint(1)\n```\n" + md("int x = 1;\nstd::vector<int> v;\n", "") + \
        "\n```cpp\nint truncated("
    blocks = extract_cpp_blocks(text)
    assert len(blocks) == 2 and blocks[0] == VALID and "std::vector<int> v;" in blocks[1]
    assert extract_cpp_blocks("no code here") == []
    assert extract_cpp_blocks("```\nhello world\n```") == []  # untagged, not C++-looking


async def test_valid_passes_invalid_fails():
    v = verifier()
    r = await v.verify(md(VALID))
    assert r.passed is True and r.reason == "ok", r.to_dict()
    r = await v.verify(md(INVALID))
    assert r.passed is False and r.reason == "compile_error" and "undeclared_name" in r.blocks[0].diagnostics
    r = await v.verify(md(VALID) + md(INVALID))
    assert r.passed is False  # every block must compile
    r = await v.verify("plain prose, no code")
    assert r.passed is None and r.reason == "no_code"


ESCAPES = [
    '#include "/etc/passwd"\n',
    '#include "/dev/zero"\n',
    '#include </dev/zero>\n',
    '#include "../../../../../../dev/zero"\n',
    '#include <bits/../../../../../../etc/passwd>\n',
    '#inc\\\nlude "/dev/zero"\n',           # line splice
    '#/* c */include "/dev/zero"\n',       # comment between # and include
    '%:include "/dev/zero"\n',             # digraph
    '#define P "/etc/passwd"\n#include P\n',  # computed include
    '#include_next <stdio.h>\n',
    '#pragma GCC dependency "/etc/passwd"\n',
    '_Pragma("GCC dependency \\"/etc/passwd\\"")\n',
    '#if __has_include("/etc/passwd")\n#endif\n',
    '#import "/etc/passwd"\n',
]


@pytest.mark.parametrize("src", ESCAPES)
async def test_include_escapes_fail_fast_without_running_the_compiler(src):
    assert screen(src) is not None
    v = verifier()
    t0 = time.monotonic()
    r = await v.compile_block(src + "int main() {}\n")
    assert not r.ok and r.reason == "include_blocked"
    assert time.monotonic() - t0 < 0.5


def test_screen_allows_normal_code():
    assert screen(VALID) is None
    assert screen('#include "local.h"\n#include <sys/types.h>\n// #include "/etc/passwd"\n') is None
    assert screen('const char* s = "#include \\"/etc/passwd\\"";\n') is None  # inside a string: not a directive
    assert screen('/* \n#include "/dev/zero"\n */ int x;\n') is None      # inside a comment


async def test_even_without_the_screen_dev_zero_cannot_hang(monkeypatch):
    """Defence in depth: if a /dev/zero include reached g++, the memory/CPU/wall limits end it fast."""
    import consort_router.verifier as vmod

    monkeypatch.setattr(vmod, "screen", lambda src: None)
    v = verifier(cpu_seconds=3, memory_mb=512, wall_timeout_s=5)
    t0 = time.monotonic()
    r = await v.compile_block('#include "/dev/zero"\n')
    dt = time.monotonic() - t0
    assert not r.ok and dt < 6.0, (r.reason, dt)


async def test_runaway_template_recursion_is_cut_by_template_depth():
    src = "template <int N> struct F { static constexpr int v = F<N + 1>::v; };\nint x = F<0>::v;\n"
    r = await verifier(template_depth=64).compile_block(src)
    assert not r.ok and "template instantiation depth exceeds" in r.diagnostics and r.seconds < 10


async def test_preprocessor_bomb_is_cut_by_the_memory_limit():
    src = "#define A0 x x\n" + "".join(f"#define A{i} A{i-1} A{i-1}\n" for i in range(1, 41)) + "int A40;\n"
    t0 = time.monotonic()
    r = await verifier(cpu_seconds=5, memory_mb=256, wall_timeout_s=10).compile_block(src)
    assert not r.ok and r.reason in ("memory_limit", "cpu_limit", "killed", "timeout"), r.reason
    assert time.monotonic() - t0 < 10


async def test_huge_pack_expansion_is_cut():
    src = ("#include <utility>\ntemplate <int... I> constexpr int s(std::integer_sequence<int, I...>) "
           "{ return (I + ... + 0); }\nconstexpr int r = s(std::make_integer_sequence<int, 50000000>{});\n")
    r = await verifier(cpu_seconds=5, memory_mb=512, wall_timeout_s=10).compile_block(src)
    assert not r.ok and r.reason in ("memory_limit", "cpu_limit", "killed", "timeout"), r.reason


async def test_cpu_limit_and_wall_timeout():
    # nested loops stay under -fconstexpr-loop-limit but would run for days
    loop = ("constexpr long f() { long s = 0; for (long i = 0; i < 200000; ++i) for (long j = 0; j < 200000; ++j)"
            " for (long k = 0; k < 200000; ++k) s ^= i + j + k; return s; }\nconstexpr long y = f();\n")
    # ops limit high enough that only the CPU limit stops it
    r = await verifier(cpu_seconds=2, wall_timeout_s=20, constexpr_ops_limit=1 << 62).compile_block(loop)
    assert not r.ok and r.reason == "cpu_limit" and r.seconds < 10, (r.reason, r.seconds)
    # wall timeout below the CPU limit: the process group is killed
    t0 = time.monotonic()
    r = await verifier(cpu_seconds=60, wall_timeout_s=1.5, constexpr_ops_limit=1 << 62).compile_block(loop)
    assert not r.ok and r.reason == "timeout" and time.monotonic() - t0 < 5


async def test_constexpr_ops_limit():
    loop = "constexpr long f() { long s = 0; for (long i = 0;; ++i) s += i; return s; }\nconstexpr long y = f();\n"
    r = await verifier(constexpr_ops_limit=1 << 16).compile_block(loop)
    assert not r.ok and r.reason == "compile_error" and "constexpr" in r.diagnostics


async def test_oversize_code_is_not_compiled():
    r = await verifier(max_code_bytes=100).compile_block("int x;\n" * 100)
    assert not r.ok and r.reason == "too_large"


async def test_bounded_concurrency():
    v = verifier(max_concurrency=1)
    active = 0
    peak = 0
    orig = v.sem

    class Probe:
        async def __aenter__(self):
            nonlocal active, peak
            await orig.acquire()
            active += 1
            peak = max(peak, active)

        async def __aexit__(self, *a):
            nonlocal active
            active -= 1
            orig.release()

    v.sem = Probe()
    res = await asyncio.gather(*(v.compile_block(f"int x{i} = {i};\n") for i in range(4)))
    assert all(r.ok for r in res) and peak == 1


async def test_no_network_and_scrubbed_env(tmp_path, monkeypatch):
    v = verifier()
    if os.geteuid() == 0:
        assert v.unshare[-2:] == ["-n", "--"]  # root here: the compiler runs without a network
    if v.unshare:
        import subprocess
        out = subprocess.run([*v.unshare, "cat", "/proc/net/dev"], capture_output=True, text=True, timeout=10)
        assert [ln.split(":")[0].strip() for ln in out.stdout.splitlines()[2:]] == ["lo"]  # only loopback
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", "/etc")
    # with CPLUS_INCLUDE_PATH=/etc, <passwd> would resolve; the scrubbed env must not see it
    r = await v.compile_block("#include <passwd>\n")
    assert not r.ok and "No such file" in r.diagnostics
