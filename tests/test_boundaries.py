"""The import rules of the two halves, held in one place (README "Design notes"):

- orchestrator/, reval/ and benchmarks/ import from remote_payload only its contract (`remote_payload.contract`,
  and the package's `__version__`): the laptop never depends on how the server half is built;
- nothing in remote_payload imports orchestrator or reval;
- remote_payload.contract and remote_payload.runtime run where only a bare python is: stdlib + remote_payload,
  no torch (checked in a fresh interpreter, so a transitive import counts too);
- the laptop side's entry points never load torch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAPTOP = ("orchestrator", "reval", "benchmarks")


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in a file, relative ones resolved against its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(pkg[:len(pkg) - node.level + 1] + ((mod,) if mod else ()))
            out.append((node.lineno, mod, [a.name for a in node.names]))
    return out


def _py_files(*tops: str) -> list[Path]:
    return sorted(f for top in tops for f in (ROOT / top).rglob("*.py"))


def test_the_laptop_side_imports_only_the_payloads_contract():
    bad = []
    for f in _py_files(*LAPTOP):
        for line, mod, names in _imports(f):
            if mod == "remote_payload":
                extra = [n for n in names if n not in ("__version__", "contract")]
                if extra:
                    bad.append(f"{f.relative_to(ROOT)}:{line} imports {extra} from remote_payload")
            elif mod.startswith("remote_payload.") and not mod.startswith("remote_payload.contract"):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "orchestrator/reval/benchmarks may import only remote_payload.contract:\n" + "\n".join(bad)


def test_the_payload_never_imports_the_laptop_side():
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in _py_files("remote_payload")
           for line, mod, _ in _imports(f) if mod.split(".")[0] in ("orchestrator", "reval")]
    assert not bad, "\n".join(bad)


def test_contract_and_runtime_are_stdlib_only():
    mods = [".".join(f.relative_to(ROOT).with_suffix("").parts) for f in _py_files("remote_payload/contract",
                                                                                    "remote_payload/runtime")]
    assert "remote_payload.contract.protocol" in mods and "remote_payload.runtime.wrapper" in mods
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m.removesuffix('.__init__'))\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
            " - {'remote_payload', '__main__', '_virtualenv'} - {m for m in sys.modules if m.startswith('__editable')})\n"
            "print(','.join(bad))")
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "", f"contract/runtime import non-stdlib modules: {p.stdout.strip()}"


def test_a_rule_breaker_is_caught(tmp_path):
    """The checker itself: an orchestrator-style file importing the eval is reported."""
    f = ROOT / "orchestrator" / "_boundary_probe.py"
    f.write_text("from remote_payload.eval import config\nfrom remote_payload import contract\n")
    try:
        bad = [(mod, names) for _, mod, names in _imports(f)]
        assert ("remote_payload.eval", ["config"]) in bad
        try:
            test_the_laptop_side_imports_only_the_payloads_contract()
        except AssertionError as e:
            assert "_boundary_probe.py:1 imports remote_payload.eval" in str(e)
        else:
            raise AssertionError("the rule breaker was not caught")
    finally:
        f.unlink()


def test_laptop_entry_points_never_load_torch():
    code = ("import sys; import reval.cli, reval.cli.commands.run, reval.cli.commands.runs, "
            "reval.cli.commands.compare, orchestrator.results.compare, orchestrator.render.formats, "
            "orchestrator.render.plots, "
            "benchmarks.bench_run, reval\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, 'numpy' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[:2] == ["False", "False"]
