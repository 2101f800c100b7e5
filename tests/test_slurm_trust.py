"""What reval says about a Slurm run is what Slurm proved, through a real single-node Slurm (tests/slurm.py)
reached through a loopback sshd login node (the same Cluster as test_slurm_backend.py):

- a run over its time limit, followed to its end with `reval run`: the pulled status.json says
  `failed (TIMEOUT)`, as `reval status` does (Slurm's word is recorded before the pull);
- slurmctld gone for a while during a sweep: "Slurm cannot answer" is its own state (`no-answer`, said once),
  never `lost`; the ledger records the run's end once Slurm answers again;
- byte-identical checkpoints under different names: one evaluation, every name listed."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from orchestrator.runs.lifecycle import EvalSpec
from remote_payload.contract import protocol
from reval import cli
from tests import slurm as slurm_mod
from tests.slurm import Cluster

pytestmark = [pytest.mark.slurm, pytest.mark.ssh]


@pytest.fixture(scope="module")
def hpc(tmp_path_factory):
    with slurm_mod.cluster_here(tmp_path_factory.mktemp("trust")) as c:
        yield c


def reval(capsys, c: Cluster, *argv) -> tuple[int, str, str]:
    rc = cli.main(["-i", c.inv, *argv])
    o, e = capsys.readouterr()
    return rc, o, e


# --- 12a: the pulled copy of a TIMEOUT run says what `reval status` says ----------------------------------
def _cut_time_limit_once_running(hpc, name: str, stop: threading.Event) -> None:
    """Once run `name`'s job runs and its eval has written a few lines, lower its limit to 0 minutes (as root
    may): its end time becomes now, and slurmctld ends it with TIMEOUT at its next time-limit check (every 30 s,
    fixed in Slurm), instead of 60-90 s after it started. Slurm's limits are whole minutes, so a shorter limit
    cannot be asked for at submission."""
    d = hpc.run_dir(name)
    while not stop.is_set():
        try:
            job = json.loads((d / ".slurm.json").read_text())["job_id"]
            running = (d / "eval.log").read_bytes().count(b"\n") >= 3
        except (OSError, ValueError, KeyError):
            job, running = None, False
        if running and hpc.scontrol(job).get("JobState") == "RUNNING":
            hpc.slurm.cmd("scontrol", "update", f"JobId={job}", "TimeLimit=0")
            return
        stop.wait(0.1)


def test_a_followed_timeout_run_is_pulled_as_failed_timeout(hpc, capsys):
    """`reval run` on a 1-minute job that runs longer: Slurm ends it (TIMEOUT), the wrapper only sees the TERM
    and writes `cancelled`; the copy pulled at the end of the follow says failed (TIMEOUT), as status does.
    The limit is cut to 0 once the job runs (_cut_time_limit_once_running): Slurm's own time-limit kill, sooner."""
    stop = threading.Event()
    cutter = threading.Thread(target=_cut_time_limit_once_running, args=(hpc, "overtime", stop))
    cutter.start()
    try:
        rc, out, err = reval(capsys, hpc, "run", "hpc1min", "--payload", "dummy", "--name", "overtime",
                             "--", "--lines", "100000", "--interval-s", "0.2")
    finally:
        stop.set()
        cutter.join()
    assert rc == 1, (out, err)
    job = hpc.job_id("overtime")
    assert (hpc.scontrol(job)["JobState"], hpc.scontrol(job)["Reason"]) == ("TIMEOUT", "TimeLimit")
    pulled = protocol.read_json(hpc.here / "runs" / "hpc1min" / "overtime" / "status.json")
    assert (pulled["state"], pulled.get("slurm_state"), pulled.get("reason")) == ("failed", "TIMEOUT", "TIMEOUT")
    rc, out, _ = reval(capsys, hpc, "status", "hpc1min/overtime")
    assert rc == 1 and "failed (TIMEOUT)" in out, out
    assert protocol.read_json(hpc.run_dir("overtime") / "status.json") == pulled


# --- 12b: Slurm that cannot answer is not a run that is gone ------------------------------------------------
def _ledger(sweep_dir: Path) -> list[dict]:
    try:
        return list(json.loads((sweep_dir / "ledger.json").read_text())["entries"].values())
    except (OSError, ValueError, KeyError):
        return []


def _wait(what: str, ready, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_slurmctld_gone_mid_sweep_is_waited_for_never_lost(hpc):
    """slurmctld stops while a sweep's job runs (the run ends meanwhile, under slurmd alone): the sweep says
    Slurm cannot answer and waits; nothing is recorded `lost`; once slurmctld is back its COMPLETED is the
    run's end in the ledger and the report, and a second sweep evaluates nothing again."""
    from orchestrator import sweep
    from orchestrator.hosts.inventory import load_inventory
    from tests.sweeptools import make_checkpoints

    ck = make_checkpoints(hpc.root / "ckq", [21])
    sw = hpc.root / "swq"
    o = sweep.SweepOptions([f"{ck}/step-*"], ["hpc"], poll_s=0.2, sweep_dir=str(sw),
                           spec=EvalSpec(payload="dummy", extra=["--lines", "40", "--interval-s", "0.2"]))
    inv = load_inventory(hpc.inv)
    log: list[str] = []
    got: list = []
    th = threading.Thread(target=lambda: got.append(sweep.Sweep(o, inv, log=log.append).run()))
    th.start()
    try:
        def status() -> dict:
            runs = [e["run"] for e in _ledger(sw)]
            try:
                return protocol.read_json(hpc.run_dir(runs[0]) / "status.json") if runs else {}
            except (OSError, ValueError):
                return {}
        _wait("the run to start", lambda: status().get("state") == "running")
        hpc.slurm.stop_controller()
        try:
            _wait("the run to end under slurmd", lambda: status().get("state") == "succeeded")
            _wait("the sweep to say Slurm cannot answer", lambda: any("Slurm cannot answer" in x for x in log))
            time.sleep(3)  # polls while Slurm cannot answer and the run's own record says it ended
            assert [e["state"] for e in _ledger(sw)] == ["launched"], log
            assert th.is_alive() and not got, log
        finally:
            hpc.slurm.start_controller()
        th.join(timeout=180)
        assert not th.is_alive(), log
    finally:
        th.join(timeout=180)
    rep = got[0]
    assert [(x.checkpoint, x.state) for x in rep.outcomes] == [("step-21", "succeeded")], log
    assert [e["state"] for e in _ledger(sw)] == ["succeeded"]
    run = _ledger(sw)[0]["run"]
    assert protocol.read_json(hpc.run_dir(run) / "status.json")["slurm_state"] == "COMPLETED"
    said = [x for x in log if "Slurm cannot answer" in x]
    assert len(said) == 1 and said[0].startswith(f"waiting step-21: run {run} on hpc: "), log
    assert not any("lost" in x for x in log), log
    again = sweep.Sweep(o, inv, log=log.append).run()
    assert [x.state for x in again.outcomes] == ["skipped"], log


# --- 12c: one content, one evaluation, every name --------------------------------------------------------------
def test_byte_identical_checkpoints_are_evaluated_once_and_all_named(hpc):
    """step-31, step-32 and step-33 hold the same bytes: one job, one run; the report and the ledger entry name
    all three; a second sweep evaluates nothing."""
    import shutil

    from orchestrator import sweep
    from orchestrator.hosts.inventory import load_inventory
    from tests.sweeptools import make_checkpoints

    ck = make_checkpoints(hpc.root / "ckd", [31])
    for n in ("step-32", "step-33"):
        shutil.copytree(ck / "step-31", ck / n)
    sw = hpc.root / "swd"
    o = sweep.SweepOptions([f"{ck}/step-*"], ["hpc"], poll_s=0.2, sweep_dir=str(sw),
                           spec=EvalSpec(payload="dummy", extra=["--lines", "4", "--interval-s", "0.1"]))
    inv = load_inventory(hpc.inv)
    log: list[str] = []
    rep = sweep.Sweep(o, inv, log=log.append).run()
    assert [(x.checkpoint, x.state, x.also) for x in rep.outcomes] == [("step-31", "succeeded",
                                                                         ["step-32", "step-33"])], log
    assert any(x.startswith("submit  1 checkpoint(s) on hpc") for x in log), log
    runs = sorted(p.name for p in (hpc.shared / "runs").iterdir() if p.name.startswith("step-3"))
    assert len(runs) == 1, runs
    entries = _ledger(sw)
    assert [(e["checkpoint"], e["also"], e["state"]) for e in entries] == [("step-31", ["step-32", "step-33"],
                                                                             "succeeded")]
    from orchestrator.sweep.render import outcome_text, write_report_files
    assert outcome_text(rep.outcomes[0]).startswith("step-31 (= step-32, step-33)  tau ")
    write_report_files(rep)
    assert "step-31 (= step-32, step-33)" in Path(rep.files["markdown"]).read_text()
    again = sweep.Sweep(o, inv, log=log.append).run()
    assert [(x.checkpoint, x.state, x.also) for x in again.outcomes] == [("step-31", "skipped",
                                                                           ["step-32", "step-33"])], log
