"""The backend seam (orchestrator/backends): the SSH backend behind the interface, the job handle in run.json,
and the wrapper's scheduler mode (GPUs assigned by a scheduler are kept as they are)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from orchestrator.backends import get_backend
from orchestrator.backends.base import (
    BATCH_STATE,
    BATCH_SUBMIT,
    WAIT_THEN_SUBMIT,
    Backend,
    JobHandle,
    Launch,
    Submission,
    Unsupported,
)
from orchestrator.backends.slurm import SlurmBackend
from orchestrator.backends.ssh import SSHBackend
from orchestrator.errors import RunExists
from orchestrator.gpuspec import GPUS_SCHEDULER
from remote_payload.contract import protocol
from tests.runtools import fake_nvidia_smi, synced_local, wait_status, wrap

PRINT_CVD = ("import os; v = os.environ.get('CUDA_VISIBLE_DEVICES'); "
             "print('CVD=' + ('UNSET' if v is None else repr(v)))")


pytestmark = pytest.mark.usefixtures("runs_here")


def _wrap(run_dir: Path, gpus: str, env: dict, *extra: str, run_json: dict | None = None):
    """The wrapper running a probe that prints the CUDA_VISIBLE_DEVICES it was given (CVD=...)."""
    return wrap(run_dir, sys.executable, "-c", PRINT_CVD, gpus=gpus, env=env, run_json=run_json,
                extra=("--locks-dir", str(run_dir.parent / "locks"), *extra))


def _cvd_line(run_dir: Path) -> str:
    return next(ln for ln in (run_dir / "eval.log").read_text().splitlines() if ln.startswith("CVD="))


def test_scheduler_mode_keeps_the_assigned_gpus(tmp_path):
    # nvidia-smi says GPU 0 is busy: in scheduler mode it is never asked, nothing is locked
    fake_nvidia_smi(tmp_path / "bin", [(0, 9000, 97871, 99)])
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "2,3"}
    d = tmp_path / "runs" / "s1"
    p = _wrap(d, GPUS_SCHEDULER, env)
    assert p.returncode == 0, p.stderr
    assert _cvd_line(d) == "CVD='2,3'"
    st = protocol.read_json(d / "status.json")
    assert (st["state"], st["gpus"], st["device"]) == ("succeeded", [2, 3], "cuda")
    assert not (tmp_path / "runs" / "locks").exists() or not list((tmp_path / "runs" / "locks").iterdir())


def test_scheduler_mode_never_blanks_an_unset_variable(tmp_path):
    d = tmp_path / "runs" / "s2"
    assert _wrap(d, GPUS_SCHEDULER, {}).returncode == 0
    assert _cvd_line(d) == "CVD=UNSET"
    assert protocol.read_json(d / "status.json")["device"] == "cpu"
    # the contrast: --gpus none hides every GPU on purpose
    d2 = tmp_path / "runs" / "s3"
    assert _wrap(d2, "none", {"CUDA_VISIBLE_DEVICES": "1"}).returncode == 0
    assert _cvd_line(d2) == "CVD=''"


def test_wrapper_records_the_job_handle_in_run_json(tmp_path):
    d = tmp_path / "runs" / "j1"
    p = _wrap(d, GPUS_SCHEDULER, {"SLURM_JOB_ID": "4242"}, "--job-id-env", "SLURM_JOB_ID",
              run_json={"backend": "slurm", "drafter": "/d"})
    assert p.returncode == 0, p.stderr
    run = protocol.read_json(d / "run.json")
    assert run["handle"] == {"backend": "slurm", "job_id": "4242"} and run["drafter"] == "/d"
    assert JobHandle.from_json(run["handle"]) == JobHandle("slurm", "4242")
    assert JobHandle.from_json({"backend": "ssh"}) is None and JobHandle.from_json([1]) is None


def test_ssh_backend_submit_state_cancel_pull_list(tmp_path):
    host, t, wd = synced_local(tmp_path / "work")
    be = get_backend(host, t)
    assert isinstance(be, Backend) and be.kind == "ssh" and be.transport is t
    launched = be.submit(Submission("b1", ["dummy", "--lines", "400", "--interval-s", "0.05"], sys.executable,
                                    gpus="none", run_json={"drafter": "/x"}))
    assert launched.handle == JobHandle("ssh", str(launched.pgid)) and launched.pgid > 1
    assert launched.run_dir == be.run_dir("b1") == f"{wd}/runs/b1"
    run = protocol.read_json(Path(wd, "runs", "b1", "run.json"))
    assert run["handle"] == launched.handle.to_json() and run["backend"] == "ssh"
    s = be.state("b1")
    assert s is not None and s.state == protocol.RUNNING and not s.terminal
    assert "b1" in [r.name for r in be.list_runs()]
    assert be.cancel("b1", grace_s=5).state == protocol.CANCELLED
    assert be.state("b1").terminal and be.state("nope") is None
    pulled = be.pull("b1")
    assert set(pulled.files) >= {"run.json", "status.json", "eval.log"}
    assert protocol.read_json(pulled.path / "status.json")["state"] == protocol.CANCELLED


class _TwoTrips(SSHBackend):
    """The base class's wait_then_submit (state, then submit), as a backend without WAIT_THEN_SUBMIT has it."""
    abilities = frozenset()
    wait_then_submit = Backend.wait_then_submit


@pytest.mark.parametrize("cls", [SSHBackend, _TwoTrips])
def test_wait_then_submit_starts_the_next_run_only_once_the_run_ended(tmp_path, cls):
    """The long poll that starts the next run once the run ended by its status.json's word (one round trip with
    WAIT_THEN_SUBMIT, two without): a run still going, a lost run, a missing one start nothing; a name already
    started answers RunExists (a retried call is safe)."""
    host, t, wd = synced_local(tmp_path / "work")
    be = cls(host, t)
    assert be.supports(WAIT_THEN_SUBMIT) == (cls is SSHBackend)

    def sub(name):
        return Submission(name, ["dummy", "--lines", "4", "--interval-s", "0.05"], sys.executable, gpus="none",
                          run_json={"drafter": "/x"})
    be.submit(Submission("w1", ["dummy", "--lines", "4000", "--interval-s", "0.05"], sys.executable, gpus="none",
                         run_json={"drafter": "/x"}))
    st, started = be.wait_then_submit("w1", sub("w2"), wait_s=0.2)
    assert st.state == protocol.RUNNING and started is None and not Path(wd, "runs", "w2").exists()
    be.cancel("w1", grace_s=5)
    st, started = be.wait_then_submit("w1", sub("w2"), wait_s=5)
    assert st.state == protocol.CANCELLED and isinstance(started, Launch) and started.name == "w2"
    assert protocol.read_json(Path(wd, "runs", "w2", "run.json"))["drafter"] == "/x"
    st, again = be.wait_then_submit("w1", sub("w2"), wait_s=5)
    assert st.state == protocol.CANCELLED and isinstance(again, RunExists)
    assert be.wait_then_submit("nope", sub("w3"), wait_s=0.2) == (None, None)
    lost = Path(wd, "runs", "w4")
    lost.mkdir()
    (lost / "status.json").write_text('{"state": "running", "pgid": 1}')
    st, started = be.wait_then_submit("w4", sub("w3"), wait_s=0.2)
    assert st.state == protocol.LOST and started is None and not Path(wd, "runs", "w3").exists()
    assert be.wait_then_submit("w2", sub("w3"), wait_s=30)[0].state == protocol.SUCCEEDED


def test_optional_abilities_are_asked_for_never_assumed(tmp_path):
    """Batch submit and batch state are optional abilities (as pyinfra's connectors have them): the SSH backend
    has neither and says so by name; generic code asks supports() (the sweep's batch worker, its slots)."""
    host, t, _ = synced_local(tmp_path / "work")
    be = get_backend(host, t)
    assert not be.supports(BATCH_SUBMIT) and not be.supports(BATCH_STATE)
    with pytest.raises(Unsupported, match=f"{host.name} .*ssh.* has no {BATCH_SUBMIT}"):
        be.submit_many([Submission("x", ["dummy"], sys.executable)])
    with pytest.raises(Unsupported, match=BATCH_STATE):
        be.states(None)
    assert SlurmBackend.abilities >= {BATCH_SUBMIT, BATCH_STATE}
    # the run slots are the backend's word: one per listed GPU here (asked only when `gpus` is auto)
    asked: list[int] = []
    smi = "0, NVIDIA H200, 143771, 5, 0\n1, NVIDIA H200, 143771, 90000, 95\n"
    host.gpus = "auto"
    assert be.run_slots(lambda: asked.append(1) or smi) == ["auto", "auto"] and asked == [1]
    host.gpus = "none"
    assert be.run_slots(lambda: asked.append(1) or smi) == ["none"] and asked == [1]


def test_ssh_backend_stream_command_follows_a_run(tmp_path):
    from orchestrator.follow import FrameParser
    host, t, wd = synced_local(tmp_path / "work")
    be = get_backend(host, t)
    be.submit(Submission("b2", ["dummy", "--lines", "3", "--interval-s", "0"], sys.executable, gpus="none"))
    wait_status(Path(wd, "runs", "b2"))
    p = t.popen(be.stream_command("b2", python=sys.executable, log_offset=0, events_offset=0))
    out, _ = p.communicate(timeout=60)
    frames = FrameParser().feed(out)
    assert frames[-1].tag == "D" and b"prompt3" in b"".join(f.data for f in frames if f.tag == "L")
