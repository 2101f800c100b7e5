"""The laptop side stays in pieces a reader can hold: no module of orchestrator/, reval/ or benchmarks/ over
MAX_MODULE_LINES lines, no function or method over MAX_FUNCTION_LINES (its `def` line to its last, decorators
left out). Measured with ast, so a docstring or a comment counts as the lines it takes."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAPTOP = ("orchestrator", "reval", "benchmarks")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100


def _files(root: Path = ROOT) -> list[Path]:
    return sorted(f for top in LAPTOP for f in (root / top).rglob("*.py"))


def function_sizes(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method in a file, nested ones too."""
    out = []

    def walk(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)
    walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return out


def test_no_module_over_500_lines():
    sizes = {f.relative_to(ROOT): len(f.read_text(encoding="utf-8").splitlines()) for f in _files()}
    assert len(sizes) > 50  # the three trees are there
    big = [f"{f}: {n} lines" for f, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n > MAX_MODULE_LINES]
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by what they hold):\n" + "\n".join(big)


def test_no_function_over_100_lines():
    sizes = [(f.relative_to(ROOT), *s) for f in _files() for s in function_sizes(f)]
    assert len(sizes) > 500
    big = [f"{f}:{line} {name}: {n} lines" for f, name, line, n in sorted(sizes, key=lambda s: -s[3])
           if n > MAX_FUNCTION_LINES]
    assert not big, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(big)


def test_the_measure_counts_methods_and_nested_functions(tmp_path):
    lines = ["class A:", "    @staticmethod", "    def big():"]
    lines += [f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES)]
    lines += ["        def inner():", "            return 1", "        return inner", "", "", "def small():",
              "    return 2"]
    f = tmp_path / "probe.py"
    f.write_text("\n".join(lines) + "\n")
    sizes = {name: n for name, _, n in function_sizes(f)}
    assert sizes == {"A.big": MAX_FUNCTION_LINES + 4, "A.big.inner": 2, "small": 2}
