"""A sweep slot's first run over real sshd hosts: its checkpoint's copy (one rsync) starts the run itself once
the copy is complete (HostPool.copy_then_submit: the launch rides with the copy, one SSH session instead of
two). A copy that fails starts nothing; a connection cut leaves the run to its host (re-attached, never handed
to another one); a retried copy finds the run started and re-attaches; a large checkpoint is copied and
launched apart, as before."""
from __future__ import annotations

from orchestrator import ledger, sweep, sync
from orchestrator.backends import ssh as ssh_backend
from orchestrator.errors import HostUnreachable
from orchestrator.inventory import load_inventory
from orchestrator.sweep import stage
from tests.sweeptools import make_checkpoints, opts


def h16(path) -> str:
    return sweep.local_content_hash(path).split(":")[-1][:16]


def runs_on(workdir) -> list[str]:
    d = workdir / "runs"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def count_calls(monkeypatch, owner, name: str) -> list[tuple]:
    """Every call of owner.name (its positional arguments after self), in order; the real one runs."""
    calls: list[tuple] = []
    real = getattr(owner, name)

    def wrapped(self, *a, **kw):
        calls.append(a)
        return real(self, *a, **kw)
    monkeypatch.setattr(owner, name, wrapped)
    return calls


def entries(tmp_path) -> dict:
    return {e.checkpoint: e for e in ledger.Ledger(tmp_path / "sweeps" / "ledger.json").entries.values()}


def test_launch_answer_is_read_between_the_marks():
    """Pure: the launch's answer and status from the stderr of the copy it rode with."""
    mark, done = stage.LAUNCH_MARK, stage.LAUNCHED_MARK
    assert stage.launch_answer("rsync: warning\n") == (None, "")
    assert stage.launch_answer(f"ssh noise\n{mark}\n@@STATUS\n{{}}\n{done} 0\n") == (0, "@@STATUS\n{}\n")
    assert stage.launch_answer(f"{mark}\npartial answer\n") == (1, "partial answer\n")  # its end never came
    assert stage.launch_answer(f"{mark}\nx\n{done} 7\n")[0] == 7


def test_a_slots_first_launch_rides_with_its_checkpoint_copy(ssh_hosts, tmp_path, monkeypatch):
    """Two hosts, four checkpoints: each slot's first run is started by its copy's SSH session (no launch of
    its own), the later ones by the long poll; nothing is launched by a plain submit; every copy is marked
    complete where it ran, every checkpoint succeeds once."""
    cluster = ssh_hosts(2)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2, 3, 4])
    folded = count_calls(monkeypatch, stage.HostPool, "copy_then_submit")
    plain = count_calls(monkeypatch, ssh_backend.SSHBackend, "submit")
    log: list[str] = []
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["cluster"], tmp_path), load_inventory(cluster.inventory_path),
                      log=log.append).run()
    assert rep.exit_code == 0 and [o.state for o in rep.outcomes] == ["succeeded"] * 4, log
    assert len(folded) == 2 and {a[0].host.name for a in folded} == {"ssh1", "ssh2"}, folded
    assert plain == [], plain
    by_host: dict[str, list[str]] = {}
    for o in rep.outcomes:
        by_host.setdefault(o.host, []).append(o.checkpoint)
        w = cluster.hosts[int(o.host[-1]) - 1].workdir
        assert (w / "checkpoints" / h16(ck / o.checkpoint) / f"{o.checkpoint}.complete").exists()
    assert sum(len(runs_on(h.workdir)) for h in cluster.hosts) == 4
    assert {e.state for e in entries(tmp_path).values()} == {"succeeded"}
    # each slot's first `launch` line names the checkpoint its copy started
    firsts = {a[0].host.name: a[1].name for a in folded}
    for host, name in firsts.items():
        first_line = next(line for line in log if line.startswith("launch  ") and f" on {host} " in line)
        assert first_line.startswith(f"launch  {name} on {host}"), (first_line, firsts)


def test_a_copy_that_fails_starts_nothing(ssh_hosts, tmp_path, monkeypatch):
    """step-1's copy cannot land on ssh1 (its folder there is a file): step-1 fails with rsync's word and no
    run of it exists anywhere; ssh1 goes on with the others."""
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2])
    w = cluster.hosts[0].workdir
    (w / "checkpoints").mkdir(parents=True)
    (w / "checkpoints" / h16(ck / "step-1")).write_text("not a folder")
    log: list[str] = []
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["cluster"], tmp_path), load_inventory(cluster.inventory_path),
                      log=log.append).run()
    states = {o.checkpoint: o for o in rep.outcomes}
    assert states["step-1"].state == "failed" and "copying the checkpoint" in states["step-1"].error, log
    assert states["step-2"].state == "succeeded", log
    assert len(runs_on(w)) == 1 and not any(line.startswith("launch  step-1") for line in log)
    assert entries(tmp_path)["step-1"].state == "failed"  # not `launched`: nothing started


def cut_after(monkeypatch, host: str, times: int) -> list[int]:
    """The first `times` copies that a launch rides with to `host` run for real, then their connection is
    reported cut (as if it dropped right after the launch): HostUnreachable."""
    done: list[int] = []
    real = sync.rsync

    def rsync(rsh, src, dest, *, host: str = "", what: str = "", delete=False, options=None):
        p = real(rsh, src, dest, host=host, what=what, delete=delete, options=options)
        if host == cut_host and any(stage.LAUNCH_MARK in o for o in options or []) and len(done) < times:
            done.append(1)
            raise HostUnreachable(f"{host}: copying the checkpoint failed (rsync exit 255): connection cut (injected)")
        return p
    cut_host = host
    monkeypatch.setattr(stage, "rsync", rsync)
    return done


def test_a_cut_connection_leaves_the_run_to_its_host(ssh_hosts, tmp_path, monkeypatch):
    """ssh2's first copy + launch ran, then its connection is cut and no retry is left: ssh2 is out, its job is
    `unreachable` (the ledger keeps it `launched` on ssh2), never run on ssh1. The next sweep re-attaches to
    it on ssh2 and launches nothing new."""
    cluster = ssh_hosts(2)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2, 3])
    cut = cut_after(monkeypatch, "ssh2", 1)
    log: list[str] = []
    o = opts(f"{ck}/step-*", ["cluster"], tmp_path, retries=1)
    rep = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=log.append).run()
    assert cut == [1], log
    states = {x.checkpoint: x for x in rep.outcomes}
    gone = [c for c, x in states.items() if x.state == "unreachable"]
    assert len(gone) == 1 and states[gone[0]].host == "ssh2", log
    assert all(x.state == "succeeded" and x.host == "ssh1" for c, x in states.items() if c != gone[0]), log
    e = entries(tmp_path)[gone[0]]
    assert e.state == "launched" and e.host == "ssh2"
    assert runs_on(cluster.hosts[1].workdir) == [e.run]  # it did start there, and only there
    assert e.run not in runs_on(cluster.hosts[0].workdir)

    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    log.clear()
    rep2 = sweep.Sweep(o, load_inventory(cluster.inventory_path), log=log.append).run()
    by = {x.checkpoint: x for x in rep2.outcomes}
    assert rep2.exit_code == 0 and by[gone[0]].state == "succeeded" and by[gone[0]].host == "ssh2", log
    assert any(line.startswith(f"attach  {gone[0]}") for line in log) and not any(
        line.startswith("launch") for line in log), log
    assert runs_on(cluster.hosts[1].workdir) == [e.run]


def test_a_retried_copy_finds_its_run_started(ssh_hosts, tmp_path, monkeypatch):
    """The connection is cut once after the copy's launch; the retry copies nothing new and its launch finds
    the run there (the name is taken): re-attached, one run, the checkpoint succeeds on that host."""
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1])
    cut = cut_after(monkeypatch, "ssh1", 1)
    log: list[str] = []
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["cluster"], tmp_path, retries=2), load_inventory(cluster.inventory_path),
                      log=log.append).run()
    assert cut == [1] and rep.exit_code == 0, log
    assert [(x.state, x.host) for x in rep.outcomes] == [("succeeded", "ssh1")], log
    assert len(runs_on(cluster.hosts[0].workdir)) == 1
    assert any(line.startswith("attach  step-1") and "already on ssh1" in line for line in log), log


def test_a_large_checkpoint_is_copied_and_launched_apart(ssh_hosts, tmp_path, monkeypatch):
    """Above FOLD_MAX_BYTES the copy and the launch stay two steps (a cut during a long copy then starts
    nothing, and the job may go to another host): no copy_then_submit, plain launches, all succeed."""
    cluster = ssh_hosts(1)
    monkeypatch.chdir(tmp_path)
    ck = make_checkpoints(tmp_path, [1, 2])
    monkeypatch.setattr(stage, "FOLD_MAX_BYTES", 1024)  # the test checkpoints are ~2 KiB
    folded = count_calls(monkeypatch, stage.HostPool, "copy_then_submit")
    plain = count_calls(monkeypatch, ssh_backend.SSHBackend, "submit")
    rep = sweep.Sweep(opts(f"{ck}/step-*", ["cluster"], tmp_path), load_inventory(cluster.inventory_path)).run()
    assert [x.state for x in rep.outcomes] == ["succeeded"] * 2
    assert folded == [] and len(plain) == 1  # the first launch; the second rides the long poll
