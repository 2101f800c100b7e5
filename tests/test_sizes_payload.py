"""Sizes in remote_payload/: no module over MAX_MODULE_LINES lines, no function (or method) over
MAX_FUNCTION_LINES, as `ast` counts them: a module's lines, a function's end_lineno - lineno + 1 (its `def`
line to its last, decorators not counted). A room a reader can hold: past these, split by concern."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 100


def module_lines(top: Path) -> dict[str, int]:
    """{file relative to top's parent: its line count} of every .py file under `top`."""
    return {f.relative_to(top.parent).as_posix(): len(f.read_text(encoding="utf-8").splitlines())
            for f in sorted(top.rglob("*.py"))}


def function_lines(top: Path) -> dict[str, int]:
    """{'file:line name': its length} of every function and method (nested ones too) under `top`."""
    out = {}
    for f in sorted(top.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{f.relative_to(top.parent).as_posix()}:{node.lineno} {node.name}"] = (
                    node.end_lineno - node.lineno + 1)
    return out


def test_no_payload_module_is_over_500_lines():
    sizes = module_lines(ROOT / "remote_payload")
    assert "remote_payload/eval/run.py" in sizes and "remote_payload/extract/command.py" in sizes
    big = {f: n for f, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {big}"


def test_no_payload_function_is_over_100_lines():
    sizes = function_lines(ROOT / "remote_payload")
    assert any(k.endswith(" extract") and k.startswith("remote_payload/extract/command.py:") for k in sizes)
    long = {f: n for f, n in sizes.items() if n > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_size_checks_catch_a_long_module_and_a_long_method(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def + 100 + return: 102
    (pkg / "big.py").write_text(f"class C:\n    @staticmethod\n    def m():\n{body}\n        return 0\n")
    (pkg / "ok.py").write_text("def f():\n    return 1\n")
    (pkg / "huge.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert module_lines(pkg) == {"pkg/big.py": MAX_FUNCTION_LINES + 4, "pkg/huge.py": MAX_MODULE_LINES + 1,
                                 "pkg/ok.py": 2}
    assert function_lines(pkg) == {"pkg/big.py:3 m": MAX_FUNCTION_LINES + 2, "pkg/ok.py:1 f": 2}
