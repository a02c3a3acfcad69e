"""The layout's import rules, read from the source (ast), so a violation fails here, not in review.

- engine, router and operator: the engine and the router never import each other or the operator
  (the operator may import both); all three may import consort_common, which imports none of them.
- Inside the engine, one subpackage per layer, each importing only the layers below it:
  serving -> core -> spec -> model -> kv -> text; `config`, `demo_model` and `model_cache` (top-level modules)
  import only each other, and any layer may import them; `bench` may import any layer, and nothing
  but bench imports bench.
- No import cycles between modules. Imports under `if TYPE_CHECKING:` are annotations only
  (they never run), so they are not edges.
- Each image carries the packages it runs, and the router and engine images no other: the
  Dockerfiles' COPY lines.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGES = {"consort_engine": REPO / "engine-image", "consort_router": REPO / "router-image",
            "consort_operator": REPO / "operator", "consort_common": REPO / "common"}
LAYERS = ["text", "kv", "model", "spec", "core", "serving"]      # bottom to top
BASE = {"config", "demo_model", "model_cache"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path, module: str) -> set[str]:
    """Every consort_* module `module` imports at run time (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("consort_")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("consort_"):
                continue
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}   # `from pkg import module`
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p, root): p for pkg, root in PACKAGES.items() for p in (root / pkg).rglob("*.py")}
    return {m: {t for t in imports(p, m) if t in modules and t != m} for m, p in modules.items()}


def engine_layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "package"


def package_of(module: str) -> str:
    return module.partition(".")[0]


# package -> the other packages it may import
MAY_IMPORT = {"consort_common": set(), "consort_engine": {"consort_common"}, "consort_router": {"consort_common"},
              "consort_operator": {"consort_common", "consort_engine", "consort_router"}}


def test_engine_router_and_operator_keep_to_their_direction():
    bad = [(m, t) for m, ts in graph().items() for t in ts
           if package_of(t) != package_of(m) and package_of(t) not in MAY_IMPORT[package_of(m)]]
    assert not bad, bad


def test_engine_layers_import_only_downwards():
    g = graph()
    bad = []
    for m, targets in g.items():
        if not m.startswith("consort_engine."):
            continue
        src = engine_layer(m)
        for t in targets:
            if not t.startswith("consort_engine."):
                continue            # consort_common, checked by the direction test
            dst = engine_layer(t)
            if dst == "package" or src == dst or src == "bench":
                continue
            if dst == "bench":
                bad.append((m, t, "only bench imports bench"))
            elif src in BASE:
                if dst not in BASE:
                    bad.append((m, t, "config, demo_model and model_cache import no layer"))
            elif dst in BASE:
                continue
            elif LAYERS.index(dst) > LAYERS.index(src):
                bad.append((m, t, f"{src} may not import {dst}, a layer above it"))
    assert not bad, "\n".join(map(str, bad))
    layers = {engine_layer(m) for m in g if m.startswith("consort_engine.")}
    assert layers == {*LAYERS, *BASE, "bench"}, f"a module outside the layers: {layers}"


def test_no_import_cycles_between_modules():
    g = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g.get(m, ())):
            if t.startswith(m + ".") or m.startswith(t + "."):
                continue            # a package and its own modules
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_engine_top_folder_keeps_only_its_entry_modules():
    top = sorted(p.stem for p in (PACKAGES["consort_engine"] / "consort_engine").glob("*.py"))
    assert top == ["__init__", *sorted(BASE)], top


def image_sources(dockerfile: str) -> set[str]:
    """The package folders a Dockerfile copies into its image (`COPY <folder>/consort_x ...`)."""
    text = (REPO / dockerfile).read_text()
    return set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+/consort_\w+)\s", text, re.M))


def test_each_image_copies_only_the_packages_it_runs():
    assert image_sources("router-image/Dockerfile") == {"common/consort_common", "router-image/consort_router"}
    assert image_sources("engine-image/Dockerfile") == {"common/consort_common", "engine-image/consort_engine"}
    assert image_sources("operator/Dockerfile") == {"common/consort_common", "operator/consort_operator",
                                                    "router-image/consort_router"}
