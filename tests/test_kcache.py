"""The payload's kernel caches in its venv (remote_payload/runtime/kcache.py), `python -m remote_payload warm`
and `reval sync --warm`: the defaults are set before torch is imported (a real venv, torch asked where its
caches are), a user's values win, a venv that cannot be written falls back with a note, the wrapper's child
gets them, the NVRTC cubin cache survives two writers at once, and `reval sync --warm` over a real sshd."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from remote_payload.runtime import kcache

ROOT = Path(__file__).resolve().parents[1]


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (*kcache.VARIABLES, kcache.ROOT_ENV, "PYTHONPATH")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A real venv (no pip) that sees this interpreter's packages (torch, transformers) through a .pth."""
    v = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v)], check=True)
    site = Path(subprocess.run([v / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "outer.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    return v


# --- setup(), pure ------------------------------------------------------------------------------------------
def test_defaults_in_a_venv_user_values_win_and_outside_a_venv_nothing(tmp_path):
    env = {"TRITON_CACHE_DIR": "/mine/triton"}
    assert kcache.setup(env, prefix=str(tmp_path / "v"), base_prefix="/usr") is None
    root = tmp_path / "v" / "var" / "reval" / "kernel-caches"
    assert env == {**kcache.paths(root), "TRITON_CACHE_DIR": "/mine/triton", kcache.ROOT_ENV: str(root)}
    assert env["CUDA_CACHE_PATH"] == str(root / "cuda") and env["REVAL_KERNEL_CACHE"] == str(root / "reval")
    assert not root.exists()  # nothing made until a kernel is kept
    again = dict(env)
    assert kcache.setup(again, prefix="/elsewhere", base_prefix="/usr") is None and again == env  # a child: as is
    plain: dict = {}
    assert kcache.setup(plain, prefix="/usr", base_prefix="/usr") is None
    assert plain == {kcache.ROOT_ENV: kcache.USER}  # not a venv: the libraries' per-user caches
    chosen = {kcache.ROOT_ENV: str(tmp_path / "shared")}
    kcache.setup(chosen, prefix="/usr", base_prefix="/usr")
    assert chosen["TRITON_CACHE_DIR"] == str(tmp_path / "shared" / "triton")
    user = {kcache.ROOT_ENV: "user"}
    assert kcache.setup(user, prefix=str(tmp_path / "v"), base_prefix="/usr") is None
    assert user == {kcache.ROOT_ENV: "user"}


def test_a_venv_that_cannot_be_written_falls_back_with_a_note(tmp_path, monkeypatch):
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "var").write_text("a file where the caches' folder would go")
    env: dict = {}
    note = kcache.setup(env, prefix=str(tmp_path / "v"), base_prefix="/usr")
    assert env == {kcache.ROOT_ENV: kcache.USER}
    assert note.startswith("note: the venv's kernel caches: ") and "cannot be written" in note
    assert "\n" not in note and kcache.setup(env, prefix=str(tmp_path / "v"), base_prefix="/usr") is None
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro)  # a read-only folder (we may run as root)
    env = {kcache.ROOT_ENV: str(ro / "caches")}
    note = kcache.setup(env)
    assert env == {kcache.ROOT_ENV: kcache.USER} and f"REVAL_KERNEL_CACHES={ro / 'caches'}" in note


# --- a real venv: the payload's entry sets them before torch, torch and Triton see them ---------------------
SEES = """
import json, sys
import remote_payload.__main__ as m
from remote_payload.runtime import kcache
seen = []
real = kcache.setup
kcache.setup = lambda *a, **k: (seen.append("torch" in sys.modules), real(*a, **k))[1]
try:
    m.main(json.loads(sys.argv[1]))
except SystemExit:
    pass
import torch, triton
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(json.dumps({"torch_imported_before": seen, "inductor": cache_dir(), "triton": triton.knobs.cache.dir}))
"""


def test_the_payload_sets_the_venv_caches_before_torch_and_torch_sees_them(venv):
    def sees(argv: list[str], **env) -> dict:
        p = subprocess.run([venv / "bin" / "python", "-c", SEES, json.dumps(argv)], cwd=ROOT, check=False,
                           env=_clean_env(**env), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    root = venv / "var" / "reval" / "kernel-caches"
    assert sees(["eval", "--help"]) == {"torch_imported_before": [False], "inductor": str(root / "inductor"),
                                        "triton": str(root / "triton")}
    assert sees(["extract", "--help"], TORCHINDUCTOR_CACHE_DIR=str(venv / "mine")) == {
        "torch_imported_before": [False], "inductor": str(venv / "mine"), "triton": str(root / "triton")}
    from remote_payload import __main__ as m
    assert set(m.KERNEL_COMMANDS) == {"eval", "extract", "bench", "fixtures", "warm"}  # the torch commands


def test_warm_on_a_cpu_host_names_the_caches_and_has_nothing_to_warm(venv):
    p = subprocess.run([venv / "bin" / "python", "-m", "remote_payload", "warm"], cwd=ROOT, env=_clean_env(),
                       check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    root = venv / "var" / "reval" / "kernel-caches"
    assert f"CUDA_CACHE_PATH={root / 'cuda'}" in p.stdout and f"REVAL_KERNEL_CACHE={root / 'reval'}" in p.stdout
    assert p.stdout.strip().endswith("no CUDA GPU here (the kernels are compiled on a GPU host, by its first run "
                                     "or by this command there)\nnothing to warm")
    bad = subprocess.run([venv / "bin" / "python", "-m", "remote_payload", "warm", "--only", "extract", "--target",
                          "/no/such"],
                         cwd=ROOT, env=_clean_env(), check=False, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 3 and bad.stdout.strip().splitlines()[-1].startswith("error: --target /no/such: ")


def test_warm_steps_run_on_tiny_classes_on_the_cpu(monkeypatch):
    """The steps a GPU host runs, on the CPU at tiny sizes: the config juggling (one layer, a small vocabulary,
    the model built from a target's config.json) is checked here, not first on an H200."""
    import torch

    from remote_payload.contract.drafterconfig import DrafterConfig
    from remote_payload.tools import warm
    from remote_payload.tools.bench import PRESETS
    from remote_payload.tools.bench_extract import TINY
    monkeypatch.setattr(warm, "WARM_BATCH", 2)
    monkeypatch.setattr(warm, "WARM_NEW", 4)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a: None)
    cpu = torch.device("cpu")
    assert warm._warm_extract("tiny", {**TINY, "model_type": "qwen3", "layer_types": ["full_attention"] * 4},
                              cpu).endswith("s")
    assert warm._warm_eval("tiny", DrafterConfig.from_dict(PRESETS["tiny"], source="t"), cpu).endswith("s")
    assert warm._warm_rtc("", None, cpu) == "not used here (not a CUDA device)"


# --- the wrapper's child ------------------------------------------------------------------------------------
SHOW = f"import json, os; print('CACHES ' + json.dumps({{k: os.environ.get(k) for k in {kcache.VARIABLES!r}}}))"


def _wrapped(venv: Path, run_dir: Path, env: dict) -> tuple[dict, str]:
    run_dir.mkdir(parents=True)
    py = str(venv / "bin" / "python")
    p = subprocess.run([py, "-m", "remote_payload", "wrap", "--run-dir", str(run_dir), "--", py, "-c", SHOW],
                       cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=120)
    log = (run_dir / "eval.log").read_text()
    assert p.returncode == 0, log
    return json.loads(log.rsplit("CACHES ", 1)[1].splitlines()[0]), log


def test_the_wrappers_child_gets_the_venv_caches_or_the_note(venv, tmp_path):
    got, log = _wrapped(venv, tmp_path / "runs" / "a", _clean_env(TRITON_CACHE_DIR="/mine"))
    root = venv / "var" / "reval" / "kernel-caches"
    assert got == {**kcache.paths(root), "TRITON_CACHE_DIR": "/mine"} and "note:" not in log
    got, log = _wrapped(venv, tmp_path / "runs" / "b", _clean_env(REVAL_KERNEL_CACHES=str(tmp_path / "f" / "x")))
    assert got == kcache.paths(tmp_path / "f" / "x") and "note:" not in log  # a folder to be made: fine
    (tmp_path / "g").write_text("in the way")
    got, log = _wrapped(venv, tmp_path / "runs" / "c", _clean_env(REVAL_KERNEL_CACHES=str(tmp_path / "g" / "x")))
    assert got == {}.fromkeys(kcache.VARIABLES)  # the libraries' per-user defaults
    note = [line for line in log.splitlines() if "note:" in line]
    assert len(note) == 1 and note[0].startswith("[reval] note: REVAL_KERNEL_CACHES=")
    assert "cannot be written" in note[0]


# --- the NVRTC cubin cache: two writers at once -------------------------------------------------------------
def _writer(path: str, blob: bytes, n: int) -> None:
    from remote_payload.eval import rtc
    for _ in range(n):
        rtc.write_cached(Path(path), blob)


def test_the_cubin_cache_is_whole_under_two_concurrent_writers(tmp_path):
    """Two processes (two nodes sharing the venv's cache) write the same cubin over and over while this one
    reads it: every read finds the whole file or none, and no temp file is left. (Written in place, a reader
    finds half files: checked by hand against a writer that truncates and writes.)"""
    from remote_payload.eval import cudac, rtc
    path = tmp_path / "reval" / "reval-kernels-sm_90-x.cubin"
    cubin = os.urandom(4 << 20)
    blob = cudac._MAGIC + __import__("hashlib").sha256(cubin).digest() + cubin
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), cubin, 40)) for _ in range(2)]
    for p in procs:
        p.start()
    reads = torn = 0
    while any(p.is_alive() for p in procs):
        try:
            got = path.read_bytes()
        except FileNotFoundError:
            continue
        reads += 1
        torn += got != blob
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reads > 0 and torn == 0
    assert rtc.read_cached(path) == cubin and [f.name for f in path.parent.iterdir()] == [path.name]


# --- `reval sync --warm` over a real sshd ---------------------------------------------------------------------
@pytest.mark.ssh
def test_sync_warm_over_ssh_on_a_cpu_host_shows_progress_and_has_nothing_to_warm(ssh_hosts, venv, capsys,
                                                                               monkeypatch):
    from reval import cli
    monkeypatch.setenv("COLUMNS", "250")
    c = ssh_hosts(1, extra={"python": str(venv / "bin" / "python")})
    rc = cli.main(["-i", str(c.inventory_path), "sync", "ssh1", "--warm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    root = venv / "var" / "reval" / "kernel-caches"
    lines = out.splitlines()
    assert "ssh1: kernel caches:" in lines and f"ssh1:   REVAL_KERNEL_CACHE={root / 'reval'}  " in "\n".join(lines)
    assert "ssh1: nothing to warm" in lines and any(x.startswith("ssh1: no CUDA GPU here (") for x in lines)
    summary = [x for x in lines if x.startswith("ssh1  payload: ")]
    assert len(summary) == 1 and " · warm: nothing to warm  " in summary[0]
    assert cli.main(["-i", str(c.inventory_path), "sync", "ssh1", "--warm", "--no-venv"]) == 3
    err = capsys.readouterr().err
    assert "warm needs the payload's venv" in err and "Traceback" not in err


# --- the bench's "fresh host" rows ----------------------------------------------------------------------------
def test_the_bench_fresh_node_rows_empty_every_kernel_cache_and_warm_runs(tmp_path):
    """bench_process's fresh host: every cache of kcache (and their root) in an empty folder, whatever the
    bench's own environment says (a user's TRITON_CACHE_DIR, the venv default), so the row still means a fresh
    node; "after warm" runs `warm --only eval` for the eval's drafter and device first (here a CPU: nothing)."""
    from remote_payload.tools import bench_process
    from remote_payload.tools.bench import PRESETS
    env = bench_process.fresh_caches(tmp_path / "k")
    assert set(env) == {*kcache.VARIABLES, kcache.ROOT_ENV}
    child = {**_clean_env(TRITON_CACHE_DIR="/mine"), **env}
    kcache.setup(child)
    assert {v: child[v] for v in kcache.VARIABLES} == kcache.paths(tmp_path / "k")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    argv = bench_process.eval_argv(tmp_path / "d", tmp_path / "t", tmp_path / "c", __import__("torch").device("cpu"))
    bench_process.warm_caches(argv, env)  # raises when warm fails
    assert not (tmp_path / "k").exists()  # a CPU compiles nothing


FAILING_WARM = """#!/bin/sh
# the real interpreter, except that `-m remote_payload warm` prints a step and fails (a GPU step gone wrong)
if [ "$1" = "-m" ] && [ "$2" = "remote_payload" ] && [ "$3" = "warm" ]; then
  echo "[1/2] reval's CUDA C passes: failed: RuntimeError: no NVRTC"; echo "warmed in 0.1s; 1 step(s) failed"; exit 1
fi
exec %s "$@"
"""


def test_a_failed_warm_fails_its_host_in_one_line(tmp_path, capsys, monkeypatch):
    """The local host's interpreter is the real one behind a shell seam whose `warm` exits 1: sync --warm names
    the host FAILED with warm's last line and exits 2, the progress lines shown before it."""
    from reval import cli
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.chdir(tmp_path)
    py = tmp_path / "py"
    py.write_text(FAILING_WARM % sys.executable)
    py.chmod(0o755)
    box = {"local": True, "workdir": "w", "python": str(py), "venv": {"mode": "python"}}
    (tmp_path / "hosts.yaml").write_text(json.dumps({"hosts": {"box": box}}))
    rc = cli.main(["-i", "hosts.yaml", "sync", "box", "--warm"])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert "box: [1/2] reval's CUDA C passes: failed: RuntimeError: no NVRTC" in out
    failed = [x for x in out.splitlines() if x.startswith("box  FAILED")]
    want = "box  FAILED  warming the kernel caches on box failed (exit 1): warmed in 0.1s; 1 step(s) failed"
    assert failed == [want], out


def test_warm_refuses_a_bad_drafter_config_in_one_line(tmp_path, capsys):
    import argparse

    from remote_payload.tools import warm
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"hidden_size": "wide"}))
    p = argparse.ArgumentParser()
    warm.add_arguments(p)
    assert warm.main(p.parse_args(["--drafter", str(tmp_path / "d"), "--only", "eval"])) == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"error: {tmp_path / 'd' / 'config.json'}: ") and "hidden_size" in last
