"""The code's shape, for issue notes: the longest function, the biggest file, imports inside functions.

    python bench/shape.py                 # this working tree
    python bench/shape.py --against REF   # and a git ref beside it (git show, nothing checked out)

Prints one table; the ratio column is this tree over REF.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = ("tests/", "bench/", "notebooks/", "build/", ".venv/", ".hvdtests/", "setup.py")


def _sources(ref: str | None) -> dict[str, str]:
    if ref is None:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        return {f: (ROOT / f).read_text() for f in files if not f.startswith(SKIP) and (ROOT / f).exists()}
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", ref], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return {f: subprocess.run(["git", "show", f"{ref}:{f}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
            for f in files if f.endswith(".py") and not f.startswith(SKIP)}


def _function_imports(tree: ast.AST) -> int:
    count = 0

    def visit(node: ast.AST, in_function: bool) -> None:
        nonlocal count
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                count += 1
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return count


def _body_start(node: ast.AST) -> int:
    """The first line of a function's code, after its docstring."""
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    return node.body[1].lineno if docstring and len(node.body) > 1 else first.lineno


def shape(ref: str | None) -> dict[str, object]:
    """The measures of one tree: each a (value, where) pair."""
    longest, code, biggest, imports, lines = (0, ""), (0, ""), (0, ""), 0, 0
    for path, text in _sources(ref).items():
        tree = ast.parse(text)
        n = len(text.splitlines())
        lines += n
        biggest = max(biggest, (n, path))
        imports += _function_imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path}:{node.lineno} {node.name}"
                longest = max(longest, (node.end_lineno - node.lineno + 1, where))
                code = max(code, (node.end_lineno - _body_start(node) + 1, where))
    return {"longest function (lines)": longest, "longest function (code lines)": code, "biggest file (lines)": biggest,
            "imports inside functions": (imports, ""), "lines of package code": (lines, "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="a git ref to measure beside the working tree")
    args = parser.parse_args()
    now = shape(None)
    before = shape(args.against) if args.against else None
    print(f"{'measure':28} {'this tree':>10} {args.against or '':>10} {'ratio':>6}  where (this tree)")
    for key, (value, where) in now.items():
        old = before[key][0] if before else None
        ratio = f"{value / old:6.2f}" if old else ""
        print(f"{key:28} {value:>10} {old if old is not None else '':>10} {ratio:>6}  {where}")


if __name__ == "__main__":
    main()
