"""The layout's import rules, read from the source (ast), so a violation fails here, not in review.

- engine, router and operator: the engine and the router never import each other or the operator.
- Inside the engine, one subpackage per layer, each importing only the layers below it:
  serving -> core -> spec -> model -> kv -> text; `config` and `demo_model` (top-level modules)
  import only each other, and any layer may import them; `bench` may import any layer, and nothing
  but bench imports bench.
- No import cycles between engine modules. Imports under `if TYPE_CHECKING:` are annotations only
  (they never run), so they are not edges.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"consort_engine": REPO / "engine-image", "consort_router": REPO / "router-image",
            "consort_operator": REPO / "operator"}
LAYERS = ["text", "kv", "model", "spec", "core", "serving"]      # bottom to top
BASE = {"config", "demo_model"}


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


def test_engine_router_and_operator_keep_to_their_direction():
    bad = [(m, t) for m, ts in graph().items() for t in ts
           if (m.startswith("consort_engine") and not t.startswith("consort_engine"))
           or (m.startswith("consort_router") and not t.startswith("consort_router"))]
    assert not bad, bad


def test_engine_layers_import_only_downwards():
    g = graph()
    bad = []
    for m, targets in g.items():
        if not m.startswith("consort_engine."):
            continue
        src = engine_layer(m)
        for t in targets:
            dst = engine_layer(t)
            if dst == "package" or src == dst or src == "bench":
                continue
            if dst == "bench":
                bad.append((m, t, "only bench imports bench"))
            elif src in BASE:
                if dst not in BASE:
                    bad.append((m, t, "config and demo_model import no layer"))
            elif dst in BASE:
                continue
            elif LAYERS.index(dst) > LAYERS.index(src):
                bad.append((m, t, f"{src} may not import {dst}, a layer above it"))
    assert not bad, "\n".join(map(str, bad))
    layers = {engine_layer(m) for m in g if m.startswith("consort_engine.")}
    assert layers == {*LAYERS, *BASE, "bench"}, f"a module outside the layers: {layers}"


def test_no_import_cycles_between_engine_modules():
    g = {m: {t for t in ts if t.startswith("consort_engine")} for m, ts in graph().items()
         if m.startswith("consort_engine")}
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
