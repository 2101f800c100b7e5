"""The import rules of the two halves, held in one place (README "Design notes"):

- orchestrator/, reval/ and benchmarks/ import from remote_payload only its contract (`remote_payload.contract`,
  and the package's `__version__`): the laptop never depends on how the server half is built;
- nothing in remote_payload imports orchestrator or reval;
- remote_payload.contract and remote_payload.runtime run where only a bare python is: stdlib + remote_payload,
  no torch (checked in a fresh interpreter, so a transitive import counts too);
- the payload's rooms import downwards only (PAYLOAD_ROOMS): contract imports nothing else of the payload,
  runtime only the contract (never eval/ or another torch room), prompts/ and target/ the contract, eval/ the
  contract and target/, extract/ any room but tools/; and no import circle anywhere in remote_payload/ (every
  import counts, those inside functions too);
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


# The payload's rooms and what each may import of the payload (its own room, the package's __version__, and
# these). tools/ and __main__ sit on top of them all.
PAYLOAD_ROOMS = {
    "contract": set(),
    "runtime": {"contract"},
    "prompts": {"contract"},
    "target": {"contract"},
    "eval": {"contract", "target"},
    "extract": {"contract", "prompts", "target", "eval"},
}
TORCH_ROOMS = ("eval", "extract", "prompts", "target", "tools")


def _module_names(root: Path, top: str) -> dict[str, Path]:
    """{dotted module name: file} of the package `top` under `root` (a package is its __init__)."""
    return {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
            for f in sorted((root / top).rglob("*.py"))}


def _module_graph(root: Path, top: str) -> dict[str, set[str]]:
    """{module: the modules of `top` it imports}, from the source (every import statement, at the top or
    inside a function; `from pkg import mod` is an arrow to pkg.mod; relative imports resolved)."""
    mods = _module_names(root, top)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), filename=str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a graph: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _room(module: str) -> str:
    """remote_payload.eval.run -> eval; remote_payload (the package itself) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_runtime_never_imports_eval_or_a_torch_room():
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in _py_files("remote_payload/runtime")
           for line, mod, names in _imports(f)
           if (mod.startswith("remote_payload.") and _room(mod) in TORCH_ROOMS)
           or (mod == "remote_payload" and set(names) & set(TORCH_ROOMS))]
    assert not bad, "remote_payload/runtime (stdlib) may import the contract only:\n" + "\n".join(bad)


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'module imports module' for each arrow from a room to a room PAYLOAD_ROOMS does not allow it."""
    return [f"{m} imports {t}" for m, targets in sorted(graph.items()) if _room(m) in PAYLOAD_ROOMS
            for t in sorted(targets) if _room(t) not in {"", _room(m)} | PAYLOAD_ROOMS[_room(m)]]


def test_each_payload_room_imports_only_the_rooms_below_it():
    graph = _module_graph(ROOT, "remote_payload")
    assert {_room(m) for m in graph} >= set(PAYLOAD_ROOMS) | {"tools"}, "a room was renamed? PAYLOAD_ROOMS"
    bad = _upward_imports(graph)
    assert not bad, "a payload room imports a room above it (PAYLOAD_ROOMS):\n" + "\n".join(bad)


def test_no_import_circle_in_the_payload():
    graph = _module_graph(ROOT, "remote_payload")
    assert "remote_payload.extract.batching" in graph["remote_payload.extract.pool"]
    assert "remote_payload.target.forward" in graph["remote_payload.eval.online"]  # imports inside functions
    circles = _circles(graph)
    assert not circles, "import circles in remote_payload/:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_and_room_checks_catch_a_rule_breaker(tmp_path):
    """The checkers themselves, on a made-up package: a lazy import back from eval/ into extract/ is both an
    arrow up and, with extract/ importing eval/, a circle."""
    pkg = tmp_path / "remote_payload"
    for room, text in {"eval": "def f():\n    from remote_payload.extract import b\n",
                       "extract": "from ..eval import a\n"}.items():
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
        (pkg / room / ("a.py" if room == "eval" else "b.py")).write_text(text)
    (pkg / "__init__.py").write_text("")
    graph = _module_graph(tmp_path, "remote_payload")
    assert graph["remote_payload.eval.a"] == {"remote_payload.extract.b"}
    assert graph["remote_payload.extract.b"] == {"remote_payload.eval.a"}  # the relative import resolved
    assert _circles(graph) == [["remote_payload.eval.a", "remote_payload.extract.b"]]
    assert _upward_imports(graph) == ["remote_payload.eval.a imports remote_payload.extract.b"]


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
    code = ("import sys; import orchestrator.cli, orchestrator.commands.run, orchestrator.commands.runs, "
            "orchestrator.commands.compare, orchestrator.compare, orchestrator.report, orchestrator.plots, "
            "benchmarks.bench_run, reval\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, 'numpy' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[:2] == ["False", "False"]
