"""The `consort` command: one entry point, each subcommand owned by the package that implements it.

Subcommands are imported lazily so `consort router` never pays for torch and `consort crds`
never pays for either.
"""
from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module exposing `main(argv: list[str]) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("consort_engine.serving.cli", "run one specialist's paged-KV engine (OpenAI-compatible HTTP)"),
    "router": ("consort_router.cli", "run the ensemble router (OpenAI-compatible HTTP)"),
    "operator": ("consort_operator.main", "run the Kopf operator against the current kubeconfig"),
    "up": ("consort_operator.local", "run Specialists and an EnsembleRouter from manifests as local processes"),
    "crds": ("consort_operator.api.crds", "print the CRD YAML generated from the pydantic models"),
    "demo-model": ("consort_engine.demo_model", "write a small Llama-family checkpoint + tokenizer"),
    "bench": ("consort_engine.bench.cli", "benchmarks with a report (`consort bench --help`)"),
}
# `consort COMMAND SUB` implemented outside COMMAND's module: `bench local` starts `consort up`,
# which the engine package (home of the other benchmarks) does not know about.
NESTED: dict[tuple[str, str], str] = {("bench", "local"): "consort_operator.bench_local",
                                      ("bench", "affinity"): "consort_router.bench_affinity"}


def usage() -> str:
    from consort_engine.bench.cli import BENCHES   # no heavy imports: the names and one-line helps

    lines = ["usage: consort [--version] <command> [args...]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "benchmarks (consort bench <name>):"]
    lines += [f"  {name:<11} {help_}" for name, help_ in BENCHES.items()]
    lines += ["", "`consort <command> --help` lists a command's flags and their defaults."]
    return "\n".join(lines)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("consort")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Dispatch, and flush stdout here rather than at exit: a reader that closed the pipe early
    (`consort engine --help | head`) then ends the command quietly instead of with a traceback."""
    try:
        try:
            return dispatch(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush has nowhere to fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141   # 128 + SIGPIPE, what a shell reports for a tool the closed pipe killed


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("--version", "-V"):
        print(f"consort {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"consort: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    nested = NESTED.get((name, rest[0])) if rest else None
    if nested:
        return run(f"{name} {rest[0]}", nested, rest[1:])
    return run(name, SUBCOMMANDS[name][0], rest)


def run(command: str, module: str, argv: list[str]) -> int:
    """`module.main(argv)`, with the user's own mistakes as one line instead of a traceback: a path
    they named that cannot be read or written (an OSError that carries the file name), and Ctrl-C.
    Every other exception is a bug and keeps its traceback."""
    try:
        return int(importlib.import_module(module).main(argv) or 0)
    except KeyboardInterrupt:
        print(f"consort {command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.filename is None:
            raise
        print(f"consort {command}: {e.filename}: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
