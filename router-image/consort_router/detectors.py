"""Structural detectors: prompts that trip one go to its specialist regardless of the classifier.

A detector counts regex occurrences (built-in pattern set plus configured patterns) in the prompt;
`min_matches` or more trips it. Detectors are checked in configuration order; the first that trips wins.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .config import Detector

# Each occurrence of any pattern counts once. Case-sensitive, multiline.
BUILTIN_PATTERNS: dict[str, tuple[str, ...]] = {
    "sfinae_templates": (
        r"\benable_if(?:_t)?\b",
        r"\bvoid_t\b",
        r"\bdecltype\s*\(",
        r"\bstd::declval\b",
        r"\brequires\b",
        r"\bconcept\b",
        r"template\s*<[^;{}]*\btypename\s*=",
        r"\bstd::is_\w+(?:_v)?\b",
        r"\bconditional_t\b",
        r"\bSFINAE\b",
        r"::value\b",
        r"typename\s+\w+::type\b",
    ),
    "build_files": (
        r"\bcmake_minimum_required\b",
        r"\badd_(?:executable|library|subdirectory|compile_options)\s*\(",
        r"\btarget_(?:link_libraries|include_directories|compile_features|compile_definitions)\s*\(",
        r"\bfind_package\s*\(",
        r"\bCMakeLists\.txt\b",
        r"\bCMAKE_[A-Z_]+\b",
        r"\bcc_(?:library|binary|test)\s*\(",
        r"\b(?:BUILD\.bazel|WORKSPACE|MODULE\.bazel)\b",
        r"\bbazel\s+(?:build|test|run)\b",
        r'\bload\(\s*"@',
        r"\bdeps\s*=\s*\[",
        r"\bmake(?:\[\d+\])?:\s",
        r"\bninja:\s",
        r"\bcollect2: error\b",
        r"\bundefined reference to\b",
    ),
    "gdb_transcript": (
        r"^\(gdb\)",
        r"\bProgram received signal\b",
        r"^#\d+\s+0x[0-9a-fA-F]+ in ",
        r"^#\d+\s+[\w:<>~]+\s*\(",
        r"\bBreakpoint \d+\b",
        r"\bSIG(?:SEGV|ABRT|BUS|FPE|ILL)\b",
        r"\bSegmentation fault\b",
        r"\bcore dumped\b",
        r"\bAddressSanitizer\b",
        r"^\(lldb\)",
        r"\bframe #\d+",
        r"\bThread \d+ .*received signal\b",
    ),
}

SCAN_LIMIT = 64 * 1024  # characters of the prompt a detector looks at


@dataclass(frozen=True)
class CompiledDetector:
    name: str
    specialist: str
    regex: re.Pattern[str]
    min_matches: int

    def count(self, text: str, stop_at: int | None = None) -> int:
        n = 0
        for _ in self.regex.finditer(text, 0, SCAN_LIMIT):
            n += 1
            if stop_at is not None and n >= stop_at:
                break
        return n

    def trips(self, text: str) -> bool:
        return self.count(text, stop_at=self.min_matches) >= self.min_matches


def compile_detector(d: Detector) -> CompiledDetector:
    patterns = list(BUILTIN_PATTERNS[d.builtin]) if d.builtin else []
    patterns += d.patterns
    regex = re.compile("|".join(f"(?:{p})" for p in patterns), re.MULTILINE)
    return CompiledDetector(d.name, d.specialist, regex, d.min_matches)


def detect(detectors: list[CompiledDetector], text: str) -> CompiledDetector | None:
    """The first detector (in order) that trips on `text`, or None."""
    for d in detectors:
        if d.trips(text):
            return d
    return None
