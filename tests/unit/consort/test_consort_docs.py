"""The documentation is checked like code: every page under docs/ is reachable from the index
(docs/README.md, which the top README links), every relative link and #anchor resolves inside the
repository, every metric a page names is one the engine, router or operator registers, every CRD
field path (`spec.x.y`) exists in the generated schema, and pages read as a product's documentation
(no issue or session numbers)."""
from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs"
INDEX = DOCS / "README.md"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
METRIC = re.compile(r"(?<![\w./:-])(vllm:[a-zA-Z0-9_:]+|consort_[a-z0-9_]+\*?)(?![\w/(]|\.\w)")
PACKAGES = {"consort_engine", "consort_router", "consort_operator", "consort_common"}
# A whole `spec.x.y` path; one followed by ": unknown field" quotes an error about a misspelt field.
SPEC_PATH = re.compile(r"(?<![\w/])(?:(Specialist|EnsembleRouter)\.)?\.?spec((?:\.[A-Za-z][A-Za-z0-9]*)+)"
                       r"(?![A-Za-z0-9]|\.[A-Za-z])(?!: unknown field)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


@cache
def markdown_files() -> list[Path]:
    """Every Markdown file git tracks or would track (not ignored), so new pages count before a commit."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return sorted(REPO / f for f in out if (REPO / f).is_file())


def relative_links(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of each relative link of a page; path '' for a link into the page itself."""
    links = []
    for target in LINK.findall(CODE_SPAN.sub("", FENCE.sub("", page.read_text()))):
        if re.match(r"^[a-z]+:", target):   # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        links.append((path, anchor))
    return links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{1,2}(.+?)[`*_]{1,2}", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.+)$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def test_the_top_readme_links_the_docs_index():
    assert ("docs/README.md", "") in relative_links(REPO / "README.md")


def test_every_doc_is_reachable_from_the_index():
    reached, todo = set(), [INDEX]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.is_file():
            continue
        reached.add(page)
        todo += [(page.parent / path).resolve() for path, _ in relative_links(page) if path]
    unreached = [str(p.relative_to(REPO)) for p in markdown_files() if DOCS in p.parents and p not in reached]
    assert unreached == [], f"not linked from docs/README.md (directly or through linked pages): {unreached}"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for path, anchor in relative_links(page):
        target = (page.parent / path).resolve() if path else page
        if REPO not in target.parents and target != REPO:
            broken.append(f"{path}: outside the repository")
        elif not target.exists():
            broken.append(f"{path}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor}: no such heading in {target.relative_to(REPO)}")
    assert broken == [], broken


@cache
def registered_metrics() -> frozenset[str]:
    """The series names the engine, router and operator expose, from their own registries: a counter
    as NAME_total (and _created), a histogram as its family and _bucket/_sum/_count, a gauge as NAME."""
    from consort_engine.serving.metrics import EngineMetrics, SloTracker
    from consort_operator.metrics import REGISTRY as OPERATOR
    from consort_router.metrics import RouterMetrics

    engine = EngineMetrics("m", "s", stats=lambda: {}, slo=SloTracker(ttft_s=1.0, itl_s=0.1))
    names = set()
    for registry in (engine.registry, RouterMetrics().registry, OPERATOR):
        for family in registry.collect():
            suffixes = {"counter": ("_total", "_created"), "histogram": ("", "_bucket", "_sum", "_count", "_created"),
                        "summary": ("", "_sum", "_count")}.get(family.type, ("",))
            names |= {family.name + s for s in suffixes}
    return frozenset(names)


def adapter_metrics() -> set[str]:
    """The names examples/autoscaling's prometheus-adapter rules serve the engines' metrics under."""
    cm = yaml.safe_load((REPO / "examples/autoscaling/prometheus-adapter-config.yaml").read_text())
    return {rule["name"]["as"] for rule in yaml.safe_load(cm["data"]["config.yaml"])["rules"]}


def metric_mentions(page: Path) -> set[str]:
    return {m for m in METRIC.findall(page.read_text()) if m not in PACKAGES}


def test_the_metric_check_reads_real_names():
    known = registered_metrics()
    assert {"vllm:num_requests_waiting", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:time_to_first_token_seconds_bucket", "consort_router_requests_total",
            "consort_operator_specialists"} <= known
    assert "vllm:spec_decode_num_draft_tokens" not in known   # a counter is named with _total
    assert metric_mentions(DOCS / "autoscaling.md") >= {"vllm:num_requests_waiting", "consort_warm"}


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_metric_a_doc_names_is_registered(page):
    known = registered_metrics() | adapter_metrics()
    unknown = sorted(m for m in metric_mentions(page)
                     if not (m in known or m.endswith("*") and any(k.startswith(m[:-1]) for k in known)))
    assert unknown == [], f"metrics no registry defines: {unknown}"


@cache
def crd_specs() -> dict[str, dict]:
    """kind -> the openAPIV3Schema of its .spec, from the generated CRDs."""
    out = {}
    for doc in yaml.safe_load_all((REPO / "crds/consort.dev.yaml").read_text()):
        version = doc["spec"]["versions"][0]
        out[doc["spec"]["names"]["kind"]] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return out


def field_exists(schema: dict, path: list[str]) -> bool:
    for name in path:
        while schema.get("type") == "array":
            schema = schema["items"]
        if isinstance(schema.get("additionalProperties"), dict) and name not in schema.get("properties", {}):
            return True   # a map: its keys are the user's
        if name not in schema.get("properties", {}):
            return False
        schema = schema["properties"][name]
    return True


def spec_mentions(page: Path) -> list[tuple[str | None, list[str]]]:
    """(kind or None, field path) of each `spec.x.y` a page names; placeholders (spec.FIELD) left out."""
    out = []
    for kind, path in SPEC_PATH.findall(page.read_text()):
        parts = path.strip(".").split(".")
        if not any(p.isupper() for p in parts):
            out.append((kind or None, parts))
    return out


def test_the_field_check_reads_the_schema():
    spec = crd_specs()
    assert field_exists(spec["Specialist"], ["kv", "blockSize"])
    assert field_exists(spec["EnsembleRouter"], ["replicaChoice", "loadSlack"])
    assert not field_exists(spec["Specialist"], ["kv", "block_size"])
    assert field_exists(spec["Specialist"], ["tolerations", "key"])          # through an array


def test_spec_mentions(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Set `Specialist.spec.kv.blockSize`, then `.spec.model.source`; `spec.kv.block_size` is wrong.\n"
                    "An error quotes spec.replica: unknown field; kubectl explain specialist.spec.FIELD.\n")
    assert spec_mentions(page) == [("Specialist", ["kv", "blockSize"]), (None, ["model", "source"]),
                                   (None, ["kv", "block"])]


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_crd_field_a_doc_names_exists(page):
    specs = crd_specs()
    missing = [f"{kind + '.' if kind else ''}spec.{'.'.join(path)}" for kind, path in spec_mentions(page)
               if not any(field_exists(specs[k], path) for k in ([kind] if kind else specs))]
    assert missing == [], f"fields neither CRD has: {missing}"


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_docs_read_as_a_products_not_a_lab_notebook(page):
    """No issue or work-session numbers, and nothing outside the repository."""
    text = page.read_text()
    assert not re.findall(r"(?i)\b(?:issue|stop) \d+\b", text)
    assert "../shared/" not in text and "DESIGN.md" not in text


def test_the_local_prometheus_config_scrapes_consort_ups_ports():
    """examples/local-metrics/prometheus.yml names the router's port and one engine port per
    Specialist of examples/local, as `consort up` assigns them by default."""
    from consort_operator.local import load_manifests, parse_args

    args = parse_args(["-f", str(REPO / "examples/local")])
    specialists = load_manifests(args.file).specialists
    config = yaml.safe_load((REPO / "examples/local-metrics/prometheus.yml").read_text())
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in config["scrape_configs"]}
    assert targets["consort-router"] == [f"127.0.0.1:{args.port}"]
    assert targets["consort-engines"] == [f"127.0.0.1:{args.engine_base_port + i}" for i in range(len(specialists))]


def test_the_readmes_local_chart_install_uses_the_local_images_values_file():
    """The CPU path installs the chart with charts/consort/values-local.yaml (the e2e installs with the
    same file), whose images are the ones hack/images.sh builds, not the registry's defaults."""
    readme = (REPO / "README.md").read_text()
    cpu_path = readme.split("**CPU path, no registry**", 1)[1].split("**GPU path**", 1)[0]
    install = next(line for line in cpu_path.splitlines() if line.startswith("helm install"))
    install_cmd = cpu_path[cpu_path.index(install):].split("\nkubectl", 1)[0]
    assert "-f charts/consort/values-local.yaml" in install_cmd and "--set" not in install_cmd, install_cmd
    values = yaml.safe_load((REPO / "charts/consort/values-local.yaml").read_text())
    built = {ref.removeprefix("docker.io/") for ref in
             re.findall(r'^\s+"\w+ \S+ (\S+)"$', (REPO / "hack/images.sh").read_text(), re.M)}
    used = {f"{values['image']['repository']}:{values['image']['tag']}", values["engineImage"], values["routerImage"]}
    assert used <= built, (used, built)
    assert "values-local.yaml" in (REPO / "tests/e2e_real/consort/test_consort_user_path.py").read_text()
