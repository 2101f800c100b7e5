"""The wrapper (status/log/exit code/cancel, GPU locks) and launch (detached start, names, quoting),
against real processes: the local transport and, for SSH, a real sshd on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.backends.ssh import kill_run, launch, launch_script, normalize_gpus, run_state
from orchestrator.errors import ConfigError
from orchestrator.hosts.transport import SSHTransport, resolve_workdir
from remote_payload.contract import gpus, protocol
from remote_payload.runtime import wrapper
from reval.cli.commands.run import describe
from tests.runtools import (
    fake_nvidia_smi,
    group_members,
    synced_local,
    synced_ssh,
    wait_lines,
    wait_status,
    wrap,
)

DUMMY = ["dummy", "--lines", "3", "--interval-s", "0.01"]


pytestmark = pytest.mark.usefixtures("runs_here")


# -- the wrapper -------------------------------------------------------------------------------------------
def test_wrapper_success_writes_run_status_and_log(tmp_path):
    d = tmp_path / "runs" / "ok"
    rj = tmp_path / "ask.json"
    rj.write_text(json.dumps({"drafter": "/m/d"}))
    p = wrap(d, sys.executable, "-m", "remote_payload", "dummy", "--run-dir", str(d), "--lines", "3",
             "--interval-s", "0", run_json=rj)
    assert p.returncode == 0, p.stderr
    st = protocol.read_json(d / "status.json")
    assert st["state"] == "succeeded" and st["exit_code"] == 0 and st["pid"] == st["pgid"]
    assert st["finished_at"] and st["started_at"] and st["device"] == "cpu"
    run = protocol.read_json(d / "run.json")
    assert run["drafter"] == "/m/d" and run["gpus"] == []
    log = (d / "eval.log").read_text().splitlines()
    assert log[0].startswith("[reval] ok started") and log[-1].startswith("[reval] succeeded · exit 0")
    assert sum("[3/3] prompt3" in line for line in log) == 1
    assert [e["i"] for e in protocol.read_events(d / "events.jsonl") if e["stage"] == "eval"] == [1, 2, 3]
    assert protocol.read_json(d / "results.json")["schema"] == protocol.RESULTS_SCHEMA


@pytest.mark.parametrize("args,code", [(["--crash"], 1), (["--exit-code", "7"], 7)])
def test_wrapper_failure_records_exit_code_and_no_results(tmp_path, args, code):
    d = tmp_path / "runs" / "bad"
    p = wrap(d, sys.executable, "-m", "remote_payload", "dummy", "--run-dir", str(d), "--lines", "4",
             "--interval-s", "0", *args)
    assert p.returncode == code
    st = protocol.read_json(d / "status.json")
    assert (st["state"], st["exit_code"]) == ("failed", code)
    assert not (d / "results.json").exists()
    assert (d / "eval.log").read_text().splitlines()[-1].startswith(f"[reval] failed · exit {code}")


def test_wrapper_missing_command_fails_cleanly(tmp_path):
    d = tmp_path / "runs" / "nocmd"
    p = wrap(d, str(tmp_path / "no-such-program"))
    assert p.returncode == 127
    st = protocol.read_json(d / "status.json")
    assert st["state"] == "failed" and st["exit_code"] == 127 and "no-such-program" in st["error"]


def test_wrapper_term_to_group_is_cancelled_once(tmp_path):
    d = tmp_path / "runs" / "c"
    d.mkdir(parents=True)
    p = subprocess.Popen([sys.executable, "-m", "remote_payload", "wrap", "--run-dir", str(d), "--", sys.executable,
                          "-m", "remote_payload", "dummy", "--run-dir", str(d), "--lines", "500",
                          "--interval-s", "0.05"],
                         cwd=str(Path(wrapper.__file__).resolve().parents[2]), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        wait_lines(d / "eval.log", 6)
        st = protocol.read_json(d / "status.json")
        assert st["state"] == "running" and st["pgid"] == p.pid  # the wrapper leads its own group
        os.killpg(st["pgid"], signal.SIGTERM)
        assert p.wait(timeout=30) == protocol.EXIT_CANCELLED
    finally:
        if p.poll() is None:
            p.kill()
    st = protocol.read_json(d / "status.json")
    assert st["state"] == "cancelled" and st["cancelled_by"] == "SIGTERM"
    assert sum(line.startswith("[reval] cancelled") for line in (d / "eval.log").read_text().splitlines()) == 1
    assert group_members(st["pgid"]) == []


# -- GPU choice (fake nvidia-smi on PATH: a seam) -----------------------------------------------------------
def test_parse_nvidia_smi_and_idle():
    rows = gpus.usage("0, 5, 97871, 0\n1, 40000, 97871, 95\nbogus\n2, 3, 81920, [N/A]\n")
    assert [(g.index, g.memory_used_mib) for g in rows] == [(0, 5), (1, 40000), (2, 3)]
    assert [wrapper.is_idle(g) for g in rows] == [True, False, True]


def test_gpu_locks_never_shared_and_stale_lock_reclaimed(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path / "bin", [(0, 5, 97871, 0), (1, 50000, 97871, 90), (2, 5, 97871, 0)])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    locks = tmp_path / "locks"
    a, fa = wrapper.acquire_gpus("auto", locks, "a")
    b, fb = wrapper.acquire_gpus("auto", locks, "b")
    assert {a[0].index, b[0].index} == {0, 2}  # GPU 1 is busy by nvidia-smi's numbers
    with pytest.raises(wrapper.StartError, match="no free GPU"):
        wrapper.acquire_gpus("auto", locks, "c")
    with pytest.raises(wrapper.StartError, match="GPU 0 is in use by run 'a'"):
        wrapper.acquire_gpus("0", locks, "c")
    with pytest.raises(wrapper.StartError, match="GPU 5 does not exist"):
        wrapper.acquire_gpus("5", locks, "c")
    # not an ASCII index (int() read '٣' as 3), or one GPU twice (it would be locked twice): refused, one line
    with pytest.raises(wrapper.StartError, match=r"--gpus '٣': expected GPU indices"):
        wrapper.acquire_gpus("٣", locks, "c")
    with pytest.raises(wrapper.StartError, match="GPU 2 is given twice"):
        wrapper.acquire_gpus("2,2", locks, "c")
    os.close(fa[0])  # run a ended: its lock file stays, its flock is gone
    c, fc = wrapper.acquire_gpus("auto", locks, "c")
    assert c[0].index == a[0].index
    assert json.loads((locks / f"gpu{c[0].index}.lock").read_text())["run"] == "c"
    for fd in fb + fc:
        os.close(fd)


def test_gpu_lock_of_a_killed_process_is_reclaimed(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    code = ("import fcntl,os,sys,time\n"
            f"fd=os.open('{locks}/gpu0.lock', os.O_RDWR|os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    assert wrapper._try_lock(locks, 0, "x") is None
    holder.kill()
    holder.wait()
    fd = wrapper._try_lock(locks, 0, "x")
    assert fd is not None
    os.close(fd)


def test_no_gpu_host_runs_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no nvidia-smi at all
    assert wrapper.acquire_gpus("auto", tmp_path / "locks", "r") == ([], [])
    with pytest.raises(wrapper.StartError, match="does not exist"):
        wrapper.acquire_gpus("0", tmp_path / "locks", "r")


# -- launch (local transport: the same script as over SSH) --------------------------------------------------
def test_launch_two_runs_get_distinct_gpus_and_cuda_visible_devices(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", [(0, 5, 97871, 0), (1, 5, 97871, 0)])
    host, t, _ = synced_local(tmp_path / "work", env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    long = ["dummy", "--lines", "400", "--interval-s", "0.05"]
    infos = [launch(host, t, name=f"g{i}", payload_argv=long, gpus="auto", run_json={}, python=sys.executable)
             for i in range(2)]
    try:
        assert sorted(i.gpus[0] for i in infos) == [0, 1]
        assert "GPU" in describe(infos[0], "auto") and "free" in describe(infos[0], "auto")
        for info in infos:
            child = next(p for p in group_members(info.pgid) if p != info.pid)
            raw = Path(f"/proc/{child}/environ").read_text()
            env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
            assert env["CUDA_VISIBLE_DEVICES"] == str(info.gpus[0]) and env["PYTHONUNBUFFERED"] == "1"
        with pytest.raises(ConfigError, match="no free GPU"):
            launch(host, t, name="g2", payload_argv=long, gpus="auto", run_json={}, python=sys.executable)
        assert not (tmp_path / "work" / "runs" / "g2").exists()  # nothing half-written
        kill_run(t, "g0", grace_s=5)
        g3 = launch(host, t, name="g3", payload_argv=DUMMY, gpus="auto", run_json={}, python=sys.executable)
        assert g3.gpus == infos[0].gpus  # the cancelled run's GPU is free again
    finally:
        for n in ("g0", "g1", "g3"):
            s = run_state(t, n)
            if s and s.alive:
                kill_run(t, n, grace_s=2)


def test_concurrent_launches_for_one_free_gpu_exactly_one_wins(tmp_path):
    from concurrent.futures import ThreadPoolExecutor
    fake_nvidia_smi(tmp_path / "bin", [(0, 5, 97871, 0), (1, 60000, 97871, 99)])
    host, t, _ = synced_local(tmp_path / "work", env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})

    def one(i):
        try:
            return launch(host, t, name=f"race{i}", payload_argv=["dummy", "--lines", "400", "--interval-s", "0.05"],
                          gpus="auto", run_json={}, python=sys.executable)
        except ConfigError as e:
            return e
    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, range(4)))
    won = [r for r in results if not isinstance(r, ConfigError)]
    try:
        assert len(won) == 1 and won[0].gpus == [0]
        assert all("no free GPU" in str(r) for r in results if isinstance(r, ConfigError))
        assert os.listdir(tmp_path / "work" / "runs") == [won[0].name]  # the losers left nothing behind
    finally:
        for w in won:
            kill_run(t, w.name, grace_s=2)


def test_launch_refuses_used_and_invalid_names(tmp_path):
    host, t, _ = synced_local(tmp_path / "work")
    launch(host, t, name="same", payload_argv=DUMMY, gpus="none", run_json={}, python=sys.executable)
    with pytest.raises(ConfigError, match="already used") as e:
        launch(host, t, name="same", payload_argv=DUMMY, gpus="none", run_json={}, python=sys.executable)
    assert "--name" in e.value.hint
    for bad in ["../escape", "a b", "x;touch pwned", "$(touch pwned)", "'q'", ".hidden", "a/b", ""]:
        with pytest.raises(ConfigError, match="invalid run name"):
            launch(host, t, name=bad, payload_argv=DUMMY, gpus="none", run_json={}, python=sys.executable)
    assert sorted(os.listdir(tmp_path / "work" / "runs")) == ["same"]
    assert not list(tmp_path.rglob("pwned")) and not (tmp_path / "escape").exists()
    assert normalize_gpus(" 0,1 ") == "0,1"
    with pytest.raises(ConfigError):
        normalize_gpus("0;reboot")


def test_hostile_workdir_and_payload_args_stay_literal(tmp_path):
    evil_dir = tmp_path / "w d;$(touch PWN1)'q\"`touch PWN2`"
    host, t, wd = synced_local(evil_dir, env={"EVIL": "$(touch PWN3); `touch PWN4`"})
    hostile = "x'; touch PWN5; echo '$(touch PWN6)"
    info = launch(host, t, name="h1", payload_argv=[*DUMMY, "--interval-s", "0"],
                  gpus="none", run_json={"drafter": hostile}, python=sys.executable)
    st = wait_status(evil_dir / "runs" / "h1")
    assert st["state"] == "succeeded"
    assert protocol.read_json(evil_dir / "runs" / "h1" / "run.json")["drafter"] == hostile
    assert info.run_dir == f"{wd}/runs/h1"
    # launch an argument the payload rejects: it arrives as ONE literal argument
    launch(host, t, name="h2", payload_argv=["dummy", hostile], gpus="none", run_json={}, python=sys.executable)
    st2 = wait_status(evil_dir / "runs" / "h2")
    assert st2["state"] == "failed" and hostile in st2["cmd"]
    assert not [p for p in tmp_path.rglob("PWN*")] and not [p for p in os.listdir(".") if p.startswith("PWN")]


def test_launch_script_quotes_everything():
    s = launch_script("/w d", "r1", ["py", "a b", "$(x)"], {"K": "v; rm -rf /"})
    assert "'a b'" in s and "'$(x)'" in s and "'K=v; rm -rf /'" in s and "wd='/w d'" in s
    with pytest.raises(ConfigError, match="not valid"):
        launch_script("/w", "r1", ["py"], {"A;B": "1"})


@pytest.mark.ssh
def test_launch_and_kill_over_ssh(ssh_hosts, tmp_path):
    c = ssh_hosts(1)
    host, t, _ = synced_ssh(c)
    info = launch(host, t, name="remote1", payload_argv=["dummy", "--lines", "500", "--interval-s", "0.05"],
                  gpus="none", run_json={}, python=sys.executable)
    run_dir = c.hosts[0].workdir / "runs" / "remote1"
    wait_lines(run_dir / "eval.log", 5)
    t.close()  # the SSH connection goes away: the run must not
    # the server side of the connection ends (sshd's session processes gone: any hangup or broken pipe it
    # causes has happened), then the run writes on: lines written after that did not kill it
    deadline = time.monotonic() + 60
    while [p for p in c.sessions(0) if p not in group_members(info.pgid)]:
        assert time.monotonic() < deadline, f"the SSH session did not end on the server: {c.sessions(0)}"
        time.sleep(0.05)
    lines_then = (run_dir / "eval.log").read_bytes().count(b"\n")
    while (run_dir / "eval.log").read_bytes().count(b"\n") < lines_then + 3:
        assert group_members(info.pgid), "the run died with its SSH connection"
        assert time.monotonic() < deadline, "the run stopped writing after its SSH connection ended"
        time.sleep(0.05)
    t = SSHTransport(host)
    assert run_state(t, "remote1").state == "running"
    s = kill_run(t, "remote1", grace_s=5)
    assert s.state == "cancelled" and group_members(info.pgid) == []
    assert protocol.read_json(run_dir / "status.json")["state"] == "cancelled"
    assert resolve_workdir(t) == str(c.hosts[0].workdir)


def test_import_boundaries_of_the_run_path():
    """wrap/dummy/stream run where only a bare python is: stdlib + remote_payload only. The controller side of
    the run path never loads torch."""
    code = ("import sys; import remote_payload.runtime.wrapper, remote_payload.runtime.dummy, "
            "remote_payload.runtime.stream\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
            " - {'remote_payload', '__main__', '_virtualenv', '__editable___reval_0_1_0_finder'})\n"
            "print(','.join(bad))")
    p = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                       cwd=str(Path(wrapper.__file__).resolve().parents[2]))
    assert p.stdout.strip() == ""
    code = ("import sys; import reval.cli.commands.run, reval.cli.commands.runs, benchmarks.bench_run, reval\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.split() == ["False", "False"]


def test_launch_with_its_input_cut_short_starts_nothing(tmp_path):
    """A controller killed mid-launch leaves ssh's stdin empty: no run dir, no wrapper, a retryable error."""
    workdir = tmp_path / "wd"
    (workdir / "payload").mkdir(parents=True)
    script = launch_script(str(workdir), "cut", ["/bin/sh", "-c", "touch started"], {})
    out = subprocess.run(["/bin/sh", "-c", script], input=b"", capture_output=True, cwd=tmp_path,
                         check=False).stdout.decode()
    assert "@@NOINPUT" in out
    assert not (workdir / "runs" / "cut").exists() and not (workdir / "payload" / "started").exists()


def test_child_starts_after_running_status_and_knows_it_is_wrapped(tmp_path):
    """The child must find status.json (running) already there and REVAL_WRAPPED set, so the payload never
    writes a status of its own beside the wrapper's."""
    d = tmp_path / "runs" / "order"
    probe = ("import json,os,sys; d=sys.argv[1]; "
             "print(json.load(open(d+'/status.json'))['state'], os.environ['REVAL_WRAPPED'])")
    p = wrap(d, sys.executable, "-c", probe, str(d))
    assert p.returncode == 0, p.stderr
    assert "running 1" in (d / "eval.log").read_text()
    assert protocol.read_json(d / "status.json")["state"] == "succeeded"
