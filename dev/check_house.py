"""The size and cycle rules of docs/design.md, checked on hpclb's source (``make lint``).

    python dev/check_house.py [PACKAGE_DIR]        # default: hpclb

Fails (exit 1) listing every import cycle between modules (imports inside functions count; a
package's ``__init__`` counts as the package), every function over 50 code lines and every
module over 400 code lines. A code line is a line that is not blank, not a comment and not part
of a docstring. The layer order itself is import-linter's contract (.importlinter).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp
import networkx as nx

MAX_FUNCTION_LINES = 50
MAX_MODULE_LINES = 400


def _docstring_lines(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                skip.update(range(first.lineno, first.end_lineno + 1))
    return skip


def _code_lines(lines: list[str], lo: int, hi: int, skip: set[int]) -> int:
    return sum(1 for i in range(lo, hi + 1) if i not in skip and lines[i - 1].strip()
               and not lines[i - 1].lstrip().startswith("#"))


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` (tests/test_house_coverage.py checks none is missed)."""
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def size_problems(root: Path) -> list[str]:
    """One line per function over MAX_FUNCTION_LINES and module over MAX_MODULE_LINES."""
    problems = []
    for path in source_files(root):
        src = path.read_text()
        tree, lines = ast.parse(src), src.splitlines()
        skip = _docstring_lines(tree)
        n = _code_lines(lines, 1, len(lines), skip)
        if n > MAX_MODULE_LINES:
            problems.append(f"module {path}: {n} code lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                k = _code_lines(lines, node.lineno, node.end_lineno, skip)
                if k > MAX_FUNCTION_LINES:
                    problems.append(f"function {path}:{node.lineno} {node.name}: {k} code lines "
                                    f"(limit {MAX_FUNCTION_LINES})")
    return problems


def cycle_problems(package: str) -> list[str]:
    """One line per group of modules that import each other (a strongly connected component
    of the import graph, package ``__init__`` counted as the package)."""
    graph = grimp.build_graph(package, cache_dir=None)
    g = nx.DiGraph()
    for module in graph.modules:
        g.add_node(module)
        for imported in graph.find_modules_directly_imported_by(module):
            g.add_edge(module, imported)
    # `import a.b` also runs a/__init__; a package importing its own submodules is not a cycle
    # unless a submodule imports the package back, which the edges above show.
    return [f"import cycle: {' '.join(sorted(c))}"
            for c in nx.strongly_connected_components(g) if len(c) > 1]


def main(argv: list[str]) -> int:
    """Print the problems; exit status 1 when there is any."""
    root = Path(argv[0] if argv else "hpclb")
    problems = cycle_problems(root.name) + size_problems(root)
    for p in problems:
        print(p)
    print(f"check_house: {len(problems)} problem(s) in {root}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
