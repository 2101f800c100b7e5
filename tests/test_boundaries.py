"""The import rules of the two halves, held in one place (README "Design notes"):

- orchestrator/, reval/ and benchmarks/ import from remote_payload only its contract (`remote_payload.contract`,
  and the package's `__version__`): the laptop never depends on how the server half is built;
- nothing in remote_payload imports orchestrator or reval;
- remote_payload.contract and remote_payload.runtime run where only a bare python is: stdlib + remote_payload,
  no torch (checked in a fresh interpreter, so a transitive import counts too);
- the payload's rooms import downwards only (PAYLOAD_ROOMS): contract imports nothing else of the payload,
  runtime only the contract (never eval/ or another torch room), prompts/ and target/ the contract, eval/ the
  contract and target/, eagle3/ (the EAGLE-3 family) those and eval/, extract/ any room but tools/; and no import
  circle anywhere in remote_payload/;
- the laptop side's entry points never load torch;
- the CLI is above the API: nothing under orchestrator/ imports reval; reval/cli/ imports only `reval` (the API's
  face), its own modules and the rendering modules (orchestrator/render/, orchestrator/sweep/render.py); no
  command sets an environment variable to configure the library;
- no import circle in orchestrator/, reval/ or benchmarks/ (imports anywhere in a file count: at module level,
  inside functions, under TYPE_CHECKING), and orchestrator's rooms import only the rooms before them (ROOMS).
Each checker takes the tree it reads, so that the rule breakers below are planted in a temp copy of it.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAPTOP = ("orchestrator", "reval", "benchmarks")


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in a file, relative ones resolved against its package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = path.relative_to(root).with_suffix("").parts[:-1]
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


def _py_files(*tops: str, root: Path = ROOT) -> list[Path]:
    return sorted(f for top in tops for f in (root / top).rglob("*.py"))


def _check_contract_only(root: Path = ROOT) -> None:
    bad = []
    for f in _py_files(*LAPTOP, root=root):
        for line, mod, names in _imports(f, root):
            if mod == "remote_payload":
                extra = [n for n in names if n not in ("__version__", "contract")]
                if extra:
                    bad.append(f"{f.relative_to(root)}:{line} imports {extra} from remote_payload")
            elif mod.startswith("remote_payload.") and not mod.startswith("remote_payload.contract"):
                bad.append(f"{f.relative_to(root)}:{line} imports {mod}")
    assert not bad, "orchestrator/reval/benchmarks may import only remote_payload.contract:\n" + "\n".join(bad)


def test_the_laptop_side_imports_only_the_payloads_contract():
    _check_contract_only()


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
            " - {'remote_payload', '__main__', '_virtualenv'}"
            " - {m for m in sys.modules if m.startswith('__editable')})\n"
            "print(','.join(bad))")
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "", f"contract/runtime import non-stdlib modules: {p.stdout.strip()}"


def _module(f: Path, root: Path) -> str:
    parts = f.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(mod: str, names: list[str], modules: set[str]) -> set[str]:
    """The modules an import loads (`from pkg import mod` names a module, `from mod import name` the module)."""
    out = set()
    for m in [f"{mod}.{n}" for n in names if f"{mod}.{n}" in modules] or [mod]:
        parts = m.split(".")
        found = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules),
                     None)
        if found:
            out.add(found)
    return out


def _import_graph(root: Path = ROOT, tops: tuple[str, ...] = LAPTOP) -> dict[str, set[str]]:
    """module -> the modules of `tops` (the laptop side by default) it imports (anywhere in the file)."""
    files = {_module(f, root): f for f in _py_files(*tops, root=root)}
    graph = {}
    for m, f in files.items():
        graph[m] = set().union(*[_targets(mod, names, set(files)) for _, mod, names in _imports(f, root)]) - {m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle (a strongly connected set of more than one module), found by Tarjan's algorithm."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on.discard(w)
                comp.append(w)
            on.discard(v)
            if comp:
                out.append(sorted([v, *comp]))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _check_no_circle(root: Path = ROOT) -> None:
    circles = _cycles(_import_graph(root))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_import_circle_on_the_laptop_side():
    graph = _import_graph()
    assert "reval.cli" in graph["reval.__main__"] and "benchmarks.harness" in graph["benchmarks.bench_run"]
    _check_no_circle()


def _check_core_below_the_api(root: Path = ROOT) -> None:
    bad = [f"{f.relative_to(root)}:{line} imports {mod}" for f in _py_files("orchestrator", root=root)
           for line, mod, _ in _imports(f, root) if mod.split(".")[0] == "reval"]
    assert not bad, "orchestrator/ is below the API and the CLI: it never imports reval:\n" + "\n".join(bad)


def test_the_core_never_imports_the_api_or_the_cli():
    _check_core_below_the_api()


# orchestrator's rooms, each importing only the ones before it (orchestrator/__init__.py draws the map)
ROOMS = ("errors", "words", "hosts", "rundir", "results", "backends", "runs", "render", "sweep")


def _check_rooms_in_order(root: Path = ROOT) -> None:
    graph = _import_graph(root)
    room = {m: m.split(".")[1] for m in graph if m.startswith("orchestrator.")}
    assert set(room.values()) <= set(ROOMS), sorted(set(room.values()) - set(ROOMS))
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m in room for d in deps
                 if d in room and ROOMS.index(room[d]) > ROOMS.index(room[m]))
    assert not bad, f"a room imports one after it (the order: {', '.join(ROOMS)}):\n" + "\n".join(bad)


def test_the_rooms_import_only_the_rooms_before_them():
    _check_rooms_in_order()


# The payload's rooms and what each may import of the payload besides itself and the package's __version__
# (tools/ and __main__ sit on top of them all). runtime/ is a stdlib tier: it never imports a torch room.
PAYLOAD_ROOMS = {
    "contract": set(),
    "runtime": {"contract"},
    "prompts": {"contract"},
    "target": {"contract"},
    "eval": {"contract", "target"},
    "eagle3": {"contract", "target", "eval"},
    "extract": {"contract", "prompts", "target", "eval", "eagle3"},
}
TORCH_ROOMS = ("eval", "eagle3", "extract", "prompts", "target", "tools")


def _payload_room(module: str) -> str:
    """remote_payload.eval.run -> eval; remote_payload (the package itself) -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _check_runtime_imports_no_torch_room(root: Path = ROOT) -> None:
    files = _py_files("remote_payload/runtime", root=root)
    bad = [f"{f.relative_to(root)}:{line} imports {mod}"
           for f in files for line, mod, names in _imports(f, root)
           if (mod.startswith("remote_payload.") and _payload_room(mod) in TORCH_ROOMS)
           or (mod == "remote_payload" and set(names) & set(TORCH_ROOMS))]
    assert not bad, "remote_payload/runtime (stdlib) may import the contract only:\n" + "\n".join(bad)


def test_runtime_never_imports_eval_or_a_torch_room():
    _check_runtime_imports_no_torch_room()


def _check_payload_rooms(root: Path = ROOT) -> None:
    graph = _import_graph(root, ("remote_payload",))
    room = {m: _payload_room(m) for m in graph}
    assert set(room.values()) >= set(PAYLOAD_ROOMS) | {"tools"}, "a room was renamed? see PAYLOAD_ROOMS"
    bad = [f"{m} -> {d}" for m, deps in sorted(graph.items()) if room[m] in PAYLOAD_ROOMS
           for d in sorted(deps) if room[d] not in {"", room[m]} | PAYLOAD_ROOMS[room[m]]]
    assert not bad, "a payload room imports a room above it (PAYLOAD_ROOMS):\n" + "\n".join(bad)


def test_the_payload_rooms_import_only_the_rooms_below_them():
    _check_payload_rooms()


def _check_no_payload_circle(root: Path = ROOT) -> None:
    circles = _cycles(_import_graph(root, ("remote_payload",)))
    assert not circles, "import circles in remote_payload/:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_import_circle_in_the_payload():
    graph = _import_graph(ROOT, ("remote_payload",))
    assert "remote_payload.extract.batching" in graph["remote_payload.extract.pool"]
    assert "remote_payload.target.forward" in graph["remote_payload.eval.online"]  # imports inside functions
    _check_no_payload_circle()


# what reval/cli/ may import besides the standard library and third-party packages (rich): the API's face,
# its own modules, and the rendering modules (pure rendering of the API's values)
CLI_MAY_IMPORT = ("reval", "reval.cli", "orchestrator.render", "orchestrator.sweep.render")
FIRST_PARTY = ("orchestrator", "reval", "remote_payload", "benchmarks", "tests")


def _cli_import_allowed(mod: str, names: list[str], root: Path) -> bool:
    def allowed(m: str) -> bool:
        return any(m == a or m.startswith(a + ".") for a in CLI_MAY_IMPORT[1:])
    if mod == "reval":  # the face's names, never the modules behind it (reval.runs, reval.hosts, ...)
        return all(n == "cli" or not ((root / "reval" / f"{n}.py").exists() or (root / "reval" / n).is_dir())
                   for n in names)
    return allowed(mod) or bool(names) and all(allowed(f"{mod}.{n}") for n in names)


def _check_cli_imports(root: Path = ROOT) -> None:
    bad = [f"{f.relative_to(root)}:{line} imports {mod}" + (f" ({', '.join(names)})" if names else "")
           for f in _py_files("reval/cli", root=root) for line, mod, names in _imports(f, root)
           if mod.split(".")[0] in FIRST_PARTY and not _cli_import_allowed(mod, names, root)]
    assert not bad, ("reval/cli/ imports only reval (the API), reval.cli and the rendering modules "
                     f"({', '.join(CLI_MAY_IMPORT[2:])}):\n" + "\n".join(bad))


def test_the_cli_imports_only_the_api_and_rendering():
    used = {mod for f in _py_files("reval/cli") for _, mod, _ in _imports(f)}
    assert {"reval", "orchestrator.render", "orchestrator.sweep"} <= used  # what the rule is about is there
    _check_cli_imports()


def _sets_environment(tree: ast.AST) -> list[int]:
    """Lines that change os.environ (item assignment or deletion, update/setdefault/pop/clear...) or call
    os.putenv/os.unsetenv."""
    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")
    lines = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign | ast.Delete) else
                   [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        if any(isinstance(t, ast.Subscript) and is_environ(t.value) for t in targets):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            changes = is_environ(f.value) and f.attr in ("update", "setdefault", "pop", "popitem", "clear",
                                                         "__setitem__", "__delitem__")
            if changes or isinstance(f.value, ast.Name) and f.value.id == "os" and f.attr in ("putenv", "unsetenv"):
                lines.append(node.lineno)
    return lines


def _check_cli_sets_no_environment(root: Path = ROOT) -> None:
    bad = [f"{f.relative_to(root)}:{line}" for f in _py_files("reval/cli", root=root)
           for line in _sets_environment(ast.parse(f.read_text(encoding="utf-8")))]
    assert not bad, "a command configures the library through its parameters, never os.environ:\n" + "\n".join(bad)


def test_no_command_sets_environment_variables():
    probe = "import os\nos.environ['X'] = '1'\nos.environ.setdefault('Y', '')\nos.environ.get('Z')\n"
    assert _sets_environment(ast.parse(probe)) == [2, 3]
    _check_cli_sets_no_environment()


def _laptop_copy(tmp_path: Path) -> Path:
    """The laptop side copied under tmp_path (the source tree is never written)."""
    for top in LAPTOP:
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_rule_breaker_is_caught(tmp_path):
    """The checker itself: an orchestrator-style file importing the eval is reported (in a temp copy)."""
    root = _laptop_copy(tmp_path)
    f = root / "orchestrator" / "_boundary_probe.py"
    f.write_text("from remote_payload.eval import config\nfrom remote_payload import contract\n")
    bad = [(mod, names) for _, mod, names in _imports(f, root)]
    assert ("remote_payload.eval", ["config"]) in bad
    try:
        _check_contract_only(root)
    except AssertionError as e:
        assert "_boundary_probe.py:1 imports remote_payload.eval" in str(e)
    else:
        raise AssertionError("the rule breaker was not caught")
    assert not (ROOT / "orchestrator" / "_boundary_probe.py").exists()


@pytest.mark.parametrize("where, text, check, says", [
    ("orchestrator/results/_probe.py", "import reval\n", _check_core_below_the_api,
     "orchestrator/results/_probe.py:1 imports reval"),
    ("reval/cli/commands/_probe.py", "from orchestrator.runs import lifecycle\n", _check_cli_imports,
     "reval/cli/commands/_probe.py:1 imports orchestrator.runs (lifecycle)"),
    ("reval/cli/commands/_probe.py", "from reval import runs\n", _check_cli_imports,
     "reval/cli/commands/_probe.py:1 imports reval (runs)"),
    ("reval/cli/commands/_probe.py", "import os\n\ndef main(a):\n    os.environ['REVAL_RUNS_DIR'] = a\n",
     _check_cli_sets_no_environment, "reval/cli/commands/_probe.py:4"),
    ("orchestrator/errors.py", "from .runs import lifecycle\n", _check_no_circle, "orchestrator.errors"),
    ("orchestrator/hosts/gpuspec.py", "from ..runs import lifecycle\n", _check_rooms_in_order,
     "orchestrator.hosts.gpuspec -> orchestrator.runs.lifecycle"),
])
def test_each_rule_catches_its_breaker(tmp_path, where, text, check, says):
    """Each rule's checker on a temp copy with one breaker planted: it fails, naming the file and line."""
    root = _laptop_copy(tmp_path)
    check(root)  # the copy as it is keeps the rule
    f = root / where
    f.write_text(f.read_text() + text if f.exists() else text)
    with pytest.raises(AssertionError) as e:
        check(root)
    assert says in str(e.value)


def _payload_copy(tmp_path: Path) -> Path:
    """remote_payload/ copied under tmp_path (the source tree is never written)."""
    shutil.copytree(ROOT / "remote_payload", tmp_path / "remote_payload",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


LAZY_EXTRACT = "\n\ndef _probe():\n    from remote_payload.extract import command  # noqa: F401\n"


@pytest.mark.parametrize("where, text, check, says", [
    ("remote_payload/runtime/cause.py", "\n\ndef _probe():\n    from remote_payload.eval import devices\n",
     _check_runtime_imports_no_torch_room, "remote_payload/runtime/cause.py"),
    ("remote_payload/runtime/_probe.py", "from remote_payload import extract\n",
     _check_runtime_imports_no_torch_room, "remote_payload/runtime/_probe.py:1 imports remote_payload"),
    ("remote_payload/target/load.py", LAZY_EXTRACT, _check_payload_rooms,
     "remote_payload.target.load -> remote_payload.extract.command"),
    ("remote_payload/target/load.py", LAZY_EXTRACT, _check_no_payload_circle, "remote_payload.target.load"),
])
def test_each_payload_rule_catches_its_breaker(tmp_path, where, text, check, says):
    """Each payload rule's checker on a temp copy with one breaker planted (a lazy import counts)."""
    root = _payload_copy(tmp_path)
    check(root)
    f = root / where
    f.write_text(f.read_text() + text if f.exists() else text)
    with pytest.raises(AssertionError) as e:
        check(root)
    assert says in str(e.value)


def test_laptop_entry_points_never_load_torch():
    code = ("import sys; import reval.cli, reval.cli.commands.run, reval.cli.commands.runs, "
            "reval.cli.commands.compare, orchestrator.results.compare, orchestrator.render.formats, "
            "orchestrator.render.plots, "
            "benchmarks.bench_run, reval\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, 'numpy' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[:2] == ["False", "False"]
