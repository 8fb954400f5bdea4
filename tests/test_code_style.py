"""The tree stays ruff-clean (lint and format) and keeps its layers (docs/architecture.md), so
style and structure never drift between sessions."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import PROJECT_ROOT


def test_ruff_lint_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_missing_migrations():
    result = subprocess.run(
        [sys.executable, "manage.py", "makemigrations", "--check", "--dry-run"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_layers_and_acyclic_packages_hold():
    """import-linter's contracts in pyproject.toml: frontdoors > search > inference > billing >
    ragsite, each importing only those below it; the serving path never imports the reference
    engine (``inference.engine``: torch); and no cycle among a package's modules, the
    benchmarks' included. The import graph includes imports inside functions, so neither a
    cycle nor an engine import can hide in one."""
    result = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout, result.stdout
    assert "the serving path does not import the reference engine KEPT" in result.stdout


APPS = ("frontdoors", "search", "inference", "billing", "ragsite")

# First-party packages that load torch when imported: the serving processes must start without
# it (tests/ragsite/test_serving_imports.py), so the code that uses one of them only when
# asked imports it inside a function. Each stays listed only while it really loads torch.
LOADS_TORCH = ("search.reader",)


def _loads_torch(module: str) -> bool:
    return any(module == package or module.startswith(package + ".") for package in LOADS_TORCH)


def _function_local_first_party_imports(path) -> list[str]:
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                names = [alias.name for alias in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                first_party = [name for name in names if name.split(".")[0] in APPS and not _loads_torch(name)]
                if first_party or getattr(child, "level", 0):
                    found.append(f"{path.relative_to(PROJECT_ROOT)}:{child.lineno}")
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def test_no_first_party_import_inside_a_function():
    """Imports of our own modules sit at the top of a module, where the layers contract and a
    reader see them; a function-local one is how cycles used to be hidden. (Lazy imports of
    heavy third-party libraries stay allowed.)"""
    found = [
        where
        for app in APPS
        for path in sorted((PROJECT_ROOT / app).rglob("*.py"))
        if "migrations" not in path.parts
        for where in _function_local_first_party_imports(path)
    ]
    assert found == []


def test_the_packages_imported_lazily_for_torch_do_load_it():
    """The exemption above holds only for a package that needs it."""
    for package in LOADS_TORCH:
        sources = (PROJECT_ROOT / package.replace(".", "/")).rglob("*.py")
        assert any(re.search(r"^(import torch|from torch)", path.read_text(), re.M) for path in sources), package


def test_a_generations_end_has_one_way_back():
    """Issue 26: the outcome travels in the ledger entry to one consumer (billing.ledger), so
    the Celery links, the task for lost generations and the guessing from a result's shape
    are gone from the whole tree, code and docs alike."""
    gone = re.compile(r"link_error|answer_generation_lost|_result_of|_result_from_stream|FINALIZE_WATCH")
    found = [
        f"{path.relative_to(PROJECT_ROOT)}:{number}"
        for top in ("frontdoors", "search", "inference", "billing", "ragsite", "benchmarks", "docs", "tests")
        for path in sorted((PROJECT_ROOT / top).rglob("*"))
        if path.suffix in (".py", ".md", ".html", ".js") and path != Path(__file__)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if gone.search(line)
    ]
    assert found == []
