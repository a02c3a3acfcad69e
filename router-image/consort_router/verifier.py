"""The built-in C++ verifier: `g++ -fsyntax-only` on the code blocks of sampled responses, sandboxed.

Pipeline per response: extract fenced code blocks that are C++ (tagged cpp/c++/cxx/cc/hpp, or untagged
and C++-looking; unterminated fences, i.e. truncated output, are skipped) -> screen each block's
preprocessor directives (only literal `<...>` / `"..."` header names, no absolute paths, no `..`, no
computed includes, no `#include_next`/`#import`/`#embed`, no `#pragma GCC dependency`) -> compile each
block alone in a fresh temp dir with:
  * `-fsyntax-only -std=<std> -x c++ -w -fmax-errors=10`, `-ftemplate-depth`, `-fconstexpr-depth`,
    `-fconstexpr-ops-limit`;
  * RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE=0, a wall timeout that kills the process group;
  * cwd = the temp dir, scrubbed environment (no CPATH & co.), new session;
  * a fresh network namespace (`unshare -n`, or `unshare -r -n` unprivileged) when permitted.
A response passes when every C++ block compiles; a response without C++ code is not a sample.
"""
from __future__ import annotations

import asyncio
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from .config import VerifierConfig

FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
CPP_TAGS = {"cpp", "c++", "cxx", "cc", "hpp", "hxx", "h++", "cplusplus", "cuda"}
LOOKS_CPP = re.compile(r"#\s*include\b|\bstd::|\btemplate\s*<|\bint\s+main\s*\(|\bnamespace\s+\w+|\bclass\s+\w+\s*[{:]")
MAX_BLOCKS = 4

# preprocessor screening
_SPLICE = re.compile(r"\\[ \t]*\r?\n")
_TOKENS = re.compile(
    r'(?P<raw>\bR"(?P<d>[^()\\\s"]{0,16})\((?:.|\n)*?\)(?P=d)")'
    r'|(?P<line>//[^\n]*)'
    r'|(?P<block>/\*(?:.|\n)*?\*/)'
    r'|(?P<str>"(?:\\.|[^"\\\n])*")'
    r"|(?P<chr>'(?:\\.|[^'\\\n])*')"
)
_DIRECTIVE = re.compile(r"^[ \t]*(?:#|%:)[ \t]*([A-Za-z_]\w*)(.*)$", re.M)
_HEADER = re.compile(r'^\s*(<[^<>"\n]+>|"[^"<>\n]+")\s*$')
_HAS_INCLUDE = re.compile(r"__has_include(?:_next)?\s*\(\s*([^)]*)\)")
_FORBIDDEN_DIRECTIVES = {"include_next", "import", "embed"}


def extract_cpp_blocks(text: str) -> list[str]:
    out = []
    for m in FENCE_RE.finditer(text):
        tag, body = m.group(1).lower(), m.group(2)
        if tag in CPP_TAGS or (tag in ("", "c", "code", "text") and LOOKS_CPP.search(body) and ";" in body):
            if tag == "c" and not LOOKS_CPP.search(body):
                continue
            out.append(body)
    return out[:MAX_BLOCKS]


def _strip_comments(src: str) -> str:
    def repl(m: re.Match[str]) -> str:
        if m.group("line") is not None:
            return " "
        if m.group("block") is not None:
            return " " + "\n" * m.group("block").count("\n")
        return m.group(0)

    return _TOKENS.sub(repl, src)


def _bad_header(name: str) -> str | None:
    path = name[1:-1].strip()
    if not path:
        return "empty header name"
    if path.startswith(("/", "\\", "~")) or re.match(r"^[A-Za-z]:", path):
        return f"absolute header path {name}"
    if "\\" in path or ".." in path.replace("\\", "/").split("/"):
        return f"header path escapes the include directories {name}"
    return None


def screen(src: str) -> str | None:
    """None if the source may be compiled, else why not (include escapes, computed includes...)."""
    text = _strip_comments(_SPLICE.sub("", src))
    for m in _DIRECTIVE.finditer(text):
        name, rest = m.group(1), m.group(2)
        if name in _FORBIDDEN_DIRECTIVES:
            return f"#{name} is not allowed"
        if name == "include":
            h = _HEADER.match(rest)
            if h is None:
                return "computed or malformed #include (only <header> or \"header\" literals)"
            if (why := _bad_header(h.group(1))) is not None:
                return why
        if name == "pragma" and re.search(r"\bdependency\b", rest):
            return "#pragma GCC dependency is not allowed"
    if re.search(r"\b_Pragma\s*\(", text) and re.search(r"dependency", text):
        return "_Pragma dependency is not allowed"
    for m in _HAS_INCLUDE.finditer(text):
        arg = m.group(1).strip()
        if not _HEADER.match(arg):
            return "computed __has_include"
        if (why := _bad_header(arg)) is not None:
            return why
    return None


@dataclass
class BlockResult:
    ok: bool
    reason: str           # ok | compile_error | include_blocked | too_large | cpu_limit | memory_limit | timeout | error
    seconds: float = 0.0
    diagnostics: str = ""


@dataclass
class VerifyResult:
    passed: bool | None   # None: no C++ code in the response (not a sample), or dropped
    reason: str
    blocks: list[BlockResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed, "reason": self.reason,
            "blocks": [{"ok": b.ok, "reason": b.reason, "seconds": round(b.seconds, 3),
                        "diagnostics": b.diagnostics[-2000:]} for b in self.blocks],
        }


def unshare_prefix() -> list[str]:
    """A command prefix that runs the compiler in a fresh, empty network namespace, or [] if not permitted:
    `unshare -n` (root / CAP_SYS_ADMIN), else `unshare -r -n` (an unprivileged user namespace)."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    for flags in (["-n"], ["-r", "-n"]):
        try:
            if subprocess.run([exe, *flags, "--", "true"], capture_output=True, timeout=5).returncode == 0:
                return [exe, *flags, "--"]
        except (OSError, subprocess.SubprocessError):
            continue
    return []


class Verifier:
    def __init__(self, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self.sem = asyncio.Semaphore(cfg.max_concurrency)
        self.pending = 0
        gxx = shutil.which(cfg.gxx)
        self.gxx = gxx
        self.unshare: list[str] = []
        if cfg.network != "inherit" and cfg.enabled:
            self.unshare = unshare_prefix()
            if not self.unshare and cfg.network == "unshare":
                raise RuntimeError("verifier.network=unshare but neither `unshare -n` nor `unshare -r -n` is "
                                   "permitted here")

    @property
    def available(self) -> bool:
        return self.cfg.enabled and self.gxx is not None

    def argv(self, src_path: str) -> list[str]:
        c = self.cfg
        return self.unshare + [
            self.gxx or c.gxx, "-fsyntax-only", f"-std={c.std}", "-x", "c++", "-w", "-fmax-errors=10",
            "-fno-diagnostics-color", f"-ftemplate-depth={c.template_depth}",
            f"-fconstexpr-depth={c.constexpr_depth}", f"-fconstexpr-ops-limit={c.constexpr_ops_limit}",
            src_path,
        ]

    def _limits(self) -> None:  # runs in the child between fork and exec
        c = self.cfg
        resource.setrlimit(resource.RLIMIT_CPU, (c.cpu_seconds, c.cpu_seconds + 1))
        mem = c.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    async def compile_block(self, src: str) -> BlockResult:
        c = self.cfg
        if len(src.encode()) > c.max_code_bytes:
            return BlockResult(False, "too_large")
        why = screen(src)
        if why is not None:
            return BlockResult(False, "include_blocked", 0.0, why)
        if self.gxx is None:
            return BlockResult(False, "error", 0.0, f"{c.gxx} not found")
        async with self.sem:
            with tempfile.TemporaryDirectory(prefix="consort-verify-") as tmp:
                path = os.path.join(tmp, "main.cpp")
                with open(path, "w") as f:
                    f.write(src)
                env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C", "LC_ALL": "C", "HOME": tmp, "TMPDIR": tmp}
                t0 = time.monotonic()
                proc = await asyncio.create_subprocess_exec(
                    *self.argv(path), cwd=tmp, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True, preexec_fn=self._limits,
                )
                try:
                    out, _ = await asyncio.wait_for(proc.communicate(), c.wall_timeout_s)
                except asyncio.TimeoutError:
                    _kill_group(proc.pid)
                    await proc.wait()
                    return BlockResult(False, "timeout", time.monotonic() - t0)
                except asyncio.CancelledError:
                    _kill_group(proc.pid)
                    raise
                finally:
                    _kill_group(proc.pid)  # stray children of the driver, if any
                dt = time.monotonic() - t0
        diag = out.decode(errors="replace")[-c.max_output_bytes:]
        rc = proc.returncode
        if rc == 0:
            return BlockResult(True, "ok", dt, diag)
        if rc is not None and rc < 0 and -rc in (signal.SIGXCPU, signal.SIGKILL) and dt < c.wall_timeout_s:
            return BlockResult(False, "cpu_limit", dt, diag)
        if "out of memory" in diag or "virtual memory exhausted" in diag or "std::bad_alloc" in diag:
            return BlockResult(False, "memory_limit", dt, diag)
        if "cpu time limit" in diag.lower():
            return BlockResult(False, "cpu_limit", dt, diag)
        if "signal terminated program" in diag:
            return BlockResult(False, "killed", dt, diag)
        return BlockResult(False, "compile_error", dt, diag)

    async def verify(self, text: str) -> VerifyResult:
        blocks = extract_cpp_blocks(text)
        if not blocks:
            return VerifyResult(None, "no_code")
        if self.pending >= self.cfg.max_queue + self.cfg.max_concurrency:
            return VerifyResult(None, "dropped")
        self.pending += 1
        try:
            results = [await self.compile_block(b) for b in blocks]
        finally:
            self.pending -= 1
        bad = next((r for r in results if not r.ok), None)
        return VerifyResult(bad is None, "ok" if bad is None else bad.reason, results)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
