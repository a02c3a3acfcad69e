"""The README's local quickstart, run as written against a real `consort up -f examples/local`.

The blocks between `<!-- quickstart:local -->` and `<!-- /quickstart:local -->` in README.md are
extracted and run in order: the first is `make up`, which this test replaces by starting what the
Makefile's `up` target runs (`consort up -f examples/local`, checked below); every other block
runs under `bash -euo pipefail` (the `openai` one is `.venv/bin/python - <<'PY'`). Two substitutions,
both in the extracted text only:
- the router's port: the README uses 127.0.0.1:8080, which a test cannot own safely (a developer's
  `make up` or another test may hold it), so the ensemble listens on a free port and `:8080` in the
  blocks becomes that port (its engines on free ports too, `--engine-base-port 0`);
- `.venv/bin/`, the virtual environment `make up` creates, becomes the directory of the Python
  running the tests (the same .venv under `make test`).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from procs import REPO, consort_up, free_port

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the README's local quickstart, in order."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("<!-- quickstart:local -->", 1)[1].split("<!-- /quickstart:local -->", 1)[0]
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(section)]


def test_the_quickstart_starts_with_make_up_which_runs_consort_up_on_examples_local():
    blocks = quickstart_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "bash"]
    assert blocks[0][1].split("#")[0].strip() == "make up"
    # Python runs from the venv `make up` made (it has `openai`), never a bare python a fresh machine lacks it in.
    pythons = re.findall(r"(\S*python\S*) - <<", "".join(code for _, code in blocks))
    assert pythons == [".venv/bin/python"], pythons
    recipe = re.search(r"^up:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert recipe == "$(VENV)/bin/consort up -f examples/local"


@pytest.mark.timeout(400)
def test_the_quickstart_runs_as_written(tmp_path):
    port = free_port()
    venv_bin = str(Path(sys.executable).parent) + "/"

    def as_run(code: str) -> str:
        assert "127.0.0.1:8080" in code or "openai" not in code and "curl" not in code
        return code.replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace(".venv/bin/", venv_bin)

    outputs = []
    with consort_up(tmp_path, port):
        for _, code in quickstart_blocks()[1:]:
            argv = ["bash", "-euo", "pipefail", "-c", as_run(code)]
            run = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
            assert run.returncode == 0, f"block failed ({run.returncode}):\n{code}\n{run.stdout}\n{run.stderr}"
            outputs.append(run.stdout)
    curl, python = outputs
    # the headers the README promises, and the cards of the ensemble and its three specialists
    headers = {k.lower(): v.strip() for k, v in (line.split(": ", 1) for line in curl.splitlines()
                                                 if line.lower().startswith("x-"))}
    print(f"\nquickstart output:\n{curl}\n{python}")
    assert {"x-consort-specialist", "x-consort-shadow", "x-consort-breaker", "x-request-id",
            "x-consort-feedback-id"} <= set(headers)
    assert headers["x-consort-specialist"] in {"algo", "template", "stl"}
    assert all(f'"id":"{name}"' in curl.replace(" ", "") for name in ("cpp-local", "algo", "template", "stl"))
    assert python.strip(), "the openai block printed no answer"
