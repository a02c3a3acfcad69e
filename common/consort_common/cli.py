"""The `consort` command: one entry point, each subcommand owned by the package that implements it.

Subcommands are imported by module name when run, so `consort router` never pays for torch and
`consort crds` never pays for either, and an image that carries only some of the packages (the
router image has no engine and no operator) says so in one line. This package imports none of
consort_engine, consort_router and consort_operator at import time.
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
    "model-cache": ("consort_engine.model_cache", "copy checkpoints through the node-local model cache"),
    "bench": ("consort_engine.bench.cli", "benchmarks with a report (`consort bench --help`)"),
}
# `consort COMMAND SUB` implemented outside COMMAND's module: `bench local` starts `consort up`,
# which the engine package (home of the other benchmarks) does not know about.
NESTED: dict[tuple[str, str], str] = {("bench", "local"): "consort_operator.bench_local",
                                      ("bench", "affinity"): "consort_router.bench_affinity",
                                      ("bench", "kv"): "consort_router.bench_kv"}
BENCH_LIST = "consort_engine.bench.cli"   # its BENCHES: benchmark -> one-line help


def missing_package(e: ModuleNotFoundError, module: str) -> str | None:
    """The consort package `module` lives in, when `e` says that package itself is not installed
    (a dependency missing inside it is another matter: that keeps its traceback)."""
    package = module.partition(".")[0]
    return package if e.name == package else None


def usage() -> str:
    lines = ["usage: consort [--version] <command> [args...]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    try:   # the names and one-line helps (no heavy imports)
        benches: dict[str, str] = importlib.import_module(BENCH_LIST).BENCHES
    except ModuleNotFoundError as e:
        if missing_package(e, BENCH_LIST) is None:
            raise
        benches = {}   # an image without the engine: its benchmarks are not here either
    if benches:
        lines += ["", "benchmarks (consort bench <name>):"]
        lines += [f"  {name:<11} {help_}" for name, help_ in benches.items()]
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
    Every other exception is a bug and keeps its traceback. A package this image does not carry is
    said in one line too."""
    try:
        entry = importlib.import_module(module)
    except ModuleNotFoundError as e:
        package = missing_package(e, module)
        if package is None:
            raise
        print(f"consort {command}: this image has no {package} (the package that runs `consort {command}`)",
              file=sys.stderr)
        return 1
    try:
        return int(entry.main(argv) or 0)
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
