"""Test files follow one naming rule (CONTRIBUTING.md, Tests):
tests/<suite>/<component>/[<subpackage>/]test_<component>_<topic>.py. Basenames are unique across
tests/ because pytest imports them by basename (no __init__.py): a second file of the same name
stops the whole run at collection."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
SUITES = {"unit", "integration", "e2e", "e2e_real", "fidelity", "gpu"}
COMPONENTS = {"engine", "router", "operator", "common", "observability", "consort"}
REPO = TESTS.parent
# The package folders a component's tests mirror (a subfolder names one of them).
PACKAGES = {"engine": REPO / "engine-image" / "consort_engine", "router": REPO / "router-image" / "consort_router",
            "operator": REPO / "operator" / "consort_operator", "common": REPO / "common" / "consort_common"}


def follows_rule(rel: Path) -> bool:
    """rel: a test file's path relative to tests/."""
    parts = rel.parts
    if len(parts) < 3 or parts[0] not in SUITES or parts[1] not in COMPONENTS:
        return False
    component, subfolders = parts[1], parts[2:-1]
    return (rel.name.startswith(f"test_{component}_") and len(subfolders) <= 1
            and all(component in PACKAGES and (PACKAGES[component] / sub / "__init__.py").is_file()
                    for sub in subfolders))


def test_every_test_module_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)


def test_every_test_file_follows_the_naming_rule():
    wrong = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("test_*.py"))
             if not follows_rule(p.relative_to(TESTS))]
    assert not wrong, wrong


def test_the_rule_rejects_misplaced_files():
    assert follows_rule(Path("unit/engine/serving/test_engine_metrics.py"))
    for rel in ("unit/test_slo.py", "unit/engine/test_slo.py", "unit/engine/nothere/test_engine_slo.py",
                "unit/router/serving/test_router_x.py", "integration/test_router_x.py"):
        assert not follows_rule(Path(rel)), rel
