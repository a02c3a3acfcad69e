"""Every `consort` subcommand, as a real process: `--help` works and shows every flag's help and
default, and a user's mistake (a missing path, an unknown choice, a malformed URL or manifest, a
misspelt field, a busy port) exits non-zero with a line naming the command and the problem, never a
Python traceback. No case loads a model: they fail before that."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from consort_common.cli import NESTED, SUBCOMMANDS

CONSORT = str(Path(sys.executable).with_name("consort"))
ROOT = Path(__file__).resolve().parents[3]
BENCHES = ("offline", "roofline", "quant", "serve", "structured", "spec", "hybrid", "local", "affinity", "kv")
MISSING = "/nonexistent/consort-test"
NOT_A_DIR = "/dev/null/consort-test"   # cannot be created, even by root

# Files the mistakes below need, written once per test run.
CASES = Path(tempfile.mkdtemp(prefix="consort-cli-cases-"))
SPECIALIST = """apiVersion: consort.dev/v1alpha1
kind: Specialist
metadata: {name: algo}
spec:
  model: {source: %s}
"""
(CASES / "broken.yaml").write_text("kind: Specialist\nmetadata: {name: algo\nspec: [\n")
(CASES / "typo.yaml").write_text(SPECIALIST % "demo://tiny" + "  replica: 1\n")
(CASES / "bare-path.yaml").write_text(SPECIALIST % "/models/llama")
(CASES / "no-tokenizer").mkdir()
(CASES / "no-tokenizer" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
# A port that is taken for as long as this module is loaded (`consort operator --metrics-port`).
BUSY = socket.socket()
BUSY.bind(("127.0.0.1", 0))
BUSY.listen()
BUSY_PORT = BUSY.getsockname()[1]

# argv -> a fragment of the line that must explain the mistake (one case per subcommand at least)
BAD = {
    ("nosuch",): "consort: unknown command 'nosuch'",
    ("engine", "--model", MISSING, "--port", "0"): f"consort engine: fatal: {MISSING} is not a checkpoint directory",
    ("router", "--config", MISSING + ".yaml", "--port", "0"): "consort router: fatal:",
    ("operator", "--warm-signal", "bogus"): "consort operator: error: argument --warm-signal: invalid choice",
    ("up", "-f", MISSING): f"consort up: {MISSING}: no such file or directory",
    ("crds", "--out-dir", NOT_A_DIR): f"consort crds: {NOT_A_DIR}: Not a directory",
    ("demo-model", "/tmp/unused", "--arch", "gpt2"): "consort demo-model: error: argument --arch: invalid choice",
    ("demo-model", "/tmp/unused", "--lora-for", MISSING): f"consort demo-model: error: argument --lora-for: {MISSING}",
    ("model-cache", "demo://tiny"): "consort model-cache: error: expected SOURCE TARGET pairs",
    ("bench", "nosuch"): "consort bench: error: argument cmd: invalid choice",
    ("bench", "offline", "--model", MISSING): f"consort bench offline: error: argument --model: {MISSING}",
    ("bench", "roofline", "--model", MISSING): f"consort bench roofline: error: argument --model: {MISSING}",
    ("bench", "serve", "--url", "127.0.0.1:8080"): "consort bench serve: error: argument --url: '127.0.0.1:8080' is not",
    ("bench", "structured", "--model", MISSING): f"consort bench structured: error: argument --model: {MISSING}",
    ("bench", "spec", MISSING): f"consort bench spec: error: argument model: {MISSING}",
    ("bench", "hybrid", "--device", "tpu"): "consort bench hybrid: error: argument --device: invalid choice",
    ("bench", "local", "-f", MISSING): f"consort bench local: {MISSING}: no such file or directory",
    ("bench", "local", "--specialist", "nope"): "consort bench local: no Specialist nope in",
    ("bench", "affinity", "--model", MISSING): f"consort bench affinity: error: --model {MISSING}: no checkpoint",
    ("bench", "kv", "--model", MISSING): f"consort bench kv: error: --model {MISSING}: no checkpoint",
    # a newcomer's first hour
    ("up", "-f", str(CASES / "broken.yaml")): f"consort up: {CASES / 'broken.yaml'}:3:5: not valid YAML",
    ("up", "-f", str(CASES / "typo.yaml")): "Specialist algo: spec.replica: unknown field (did you mean replicas?)",
    ("up", "-f", str(CASES / "bare-path.yaml")):
        "spec.model.source: '/models/llama' is not one of pvc://CLAIM/PATH, file:///PATH (absolute), hf://",
    # free ports and a 1 s start-up budget: should the check regress, this case fails at once instead
    # of starting an ensemble on 8080
    ("up", "-f", str(ROOT / "examples/local"), "--port", "0", "--engine-base-port", "0", "--timeout", "1",
     "--api-keys-file", MISSING):
        f"consort up: error: argument --api-keys-file: {MISSING}: no such file",
    ("operator", "--metrics-host", "127.0.0.1", "--metrics-port", str(BUSY_PORT), "--kubeconfig", MISSING):
        f"consort operator: --metrics-port {BUSY_PORT} on 127.0.0.1: Address already in use",
    ("engine", "--model", str(CASES / "no-tokenizer"), "--port", "0"):
        f"consort engine: fatal: {CASES / 'no-tokenizer' / 'tokenizer.json'}: no such file",
    ("engine", "--model", "demo://tiny", "--port", "0"):
        "consort engine: --model demo://tiny: a model source URL, not a directory",
}
HELP = [(), *((c,) for c in SUBCOMMANDS), *(("bench", b) for b in BENCHES)]


def consort(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CONSORT, *argv], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, ...], subprocess.CompletedProcess[str]]:
    """Every case at once (a few import torch: seconds each), in parallel."""
    cases = [(*a, "--help") for a in HELP] + list(BAD)
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(cases, pool.map(consort, cases)))


def test_every_bench_and_nested_command_is_covered():
    assert {b for _, b in NESTED} <= set(BENCHES)
    assert {a[0] for a in BAD} >= set(SUBCOMMANDS)


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a) or "consort")
def test_help(runs, argv):
    out = runs[(*argv, "--help")]
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("argv", list(BAD), ids=lambda a: " ".join(a))
def test_user_error_is_one_line_not_a_traceback(runs, argv):
    out = runs[argv]
    assert out.returncode != 0
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("consort")]
    assert len(lines) == 1 and BAD[argv] in lines[0], out.stderr[-2000:]


def options(help_text: str) -> dict[str, str]:
    """The entries of a --help's options: first flag -> its help text (wrapped lines joined)."""
    entries: dict[str, str] = {}
    flag = None
    for line in help_text.split("options:", 1)[-1].splitlines():
        if re.match(r"  -", line):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif flag and line.startswith("    "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return {f: " ".join(text.split()) for f, text in entries.items()}


@pytest.mark.parametrize("argv", HELP[1:], ids=lambda a: " ".join(a))
def test_every_flag_has_help_and_shows_its_default(runs, argv):
    """A flag's entry carries more than its name, and its default unless it has none (required, or
    unset with the help saying what unset means)."""
    text = runs[(*argv, "--help")].stdout
    for flag, entry in options(text).items():
        if flag == "-h":
            continue
        words = entry.split()
        described = len(words) > 2 or (len(words) == 2 and not words[1].isupper())
        assert described, f"{' '.join(argv)} {flag}: no help text"


def test_engine_help_shows_the_defaults():
    """Each `consort engine` flag shows the value it defaults to; one that defaults to unset shows none."""
    from consort_engine.serving.cli import parse_args

    text = subprocess.run([CONSORT, "engine", "--help"], capture_output=True, text=True, timeout=120).stdout
    defaults = vars(parse_args(["--model", "m", "--port", "0"]))
    entries = {f: e for f, e in options(text).items() if f not in ("-h", "--model", "--port")}
    assert len(entries) >= 30
    for flag, entry in entries.items():
        default = defaults[flag.lstrip("-").replace("-", "_")]
        if default in (None, []):
            assert "(default:" not in entry, entry
        else:
            assert f"(default: {default})" in entry, entry


def test_version_is_the_package_version():
    out = subprocess.run([CONSORT, "--version"], capture_output=True, text=True, timeout=60)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.returncode == 0 and out.stdout.strip() == f"consort {expected}"


def test_top_level_help_lists_the_benchmarks_bench_help_lists(runs):
    top = runs[("--help",)].stdout
    bench = runs[("bench", "--help")].stdout
    listed = set(re.findall(r"^  (\w+) ", top.split("benchmarks", 1)[1], re.M))
    choices = set(re.search(r"\{([a-z,]+)\}", bench).group(1).split(","))
    assert listed == choices == set(BENCHES)


def test_roofline_help_shows_only_the_flags_roofline_reads(runs):
    flags = set(options(runs[("bench", "roofline", "--help")].stdout))
    assert {"--model", "--dtype", "--running", "--steps"} <= flags
    assert not flags & {"--vs-server", "--requests", "--quick", "--temperature", "--rounds", "--engine-only"}


@pytest.mark.parametrize("argv", [("--help",), ("--version",), ("engine", "--help")], ids=" ".join)
def test_a_closed_pipe_ends_output_quietly(argv):
    """`consort --help | head -1`: the reader is gone before the output is written; nothing on stderr."""
    proc = subprocess.Popen([CONSORT, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert err == ""


def without(packages: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """`consort ARGV` in a process where `packages` cannot be imported, as in an image without them."""
    code = f"""import sys
class Absent:   # finds none of `packages`, as an image that lacks them
    def find_spec(self, name, path=None, target=None):
        if name in {packages!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
from consort_common.cli import main
sys.exit(main({argv!r}))
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_command_whose_package_the_image_lacks_says_so_in_one_line():
    # the router image: no engine, no operator
    run = without(["consort_engine", "consort_operator"], ["crds"])
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.splitlines() == ["consort crds: this image has no consort_operator (the package that runs "
                                       "`consort crds`)"], run.stderr
    top = without(["consort_engine", "consort_operator"], ["--help"])
    assert top.returncode == 0 and "router " in top.stdout and "consort bench <name>" not in top.stdout, top.stdout + top.stderr


def test_crds_out_dir_is_created(tmp_path):
    out = tmp_path / "new" / "crds"
    run = subprocess.run([CONSORT, "crds", "--out-dir", str(out)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["consort.dev.yaml", "kopf.dev.yaml"]


def test_operator_metrics_port_is_not_a_port_consort_up_takes():
    from consort_operator.local import parse_args as up_args
    from consort_operator.main import parse_args as operator_args

    op, up = operator_args([]), up_args(["-f", "x"])
    taken = {up.port, 8081}   # the router of `make up`; the operator's own liveness endpoint
    taken |= {up.engine_base_port + i for i in range(16)}
    assert op.metrics_port not in taken and f":{op.metrics_port}/" not in op.liveness


@pytest.mark.parametrize("url, server", [
    ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/v1/", "http://127.0.0.1:8080"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080"),
    ("https://example.com/api/v1", "https://example.com/api"),
])
def test_bench_url_takes_the_openai_base_url_habit(url, server):
    """The OpenAI client's base_url ends in /v1; the benchmarks add /v1/... themselves."""
    from consort_engine.bench.serve import http_url

    assert http_url(url) == server


def test_missing_cpp_headers_name_the_directory(tmp_path):
    """The demo tokenizer trains on the libstdc++ headers: without them, the path and what to install."""
    from consort_engine.demo_model import cpp_files

    with pytest.raises(FileNotFoundError) as err:
        cpp_files(tmp_path)
    assert err.value.filename == str(tmp_path) and "install g++" in err.value.strerror
