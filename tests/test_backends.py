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
from orchestrator.hosts.gpuspec import GPUS_SCHEDULER
from remote_payload.contract import protocol
from tests.runtools import fake_nvidia_smi, synced_local, wait_status, wrap

PRINT_CVD = ("import os; v = os.environ.get('CUDA_VISIBLE_DEVICES'); "
             "print('CVD=' + ('UNSET' if v is None else repr(v)))")


pytestmark = pytest.mark.usefixtures("runs_here")


def handle_from_json(d) -> JobHandle | None:
    """run.json's `handle` read back as a JobHandle (None when it is not one): reval writes it, only tests read it."""
    if not isinstance(d, dict) or not isinstance(d.get("backend"), str) or d.get("job_id") in (None, ""):
        return None
    return JobHandle(d["backend"], str(d["job_id"]))


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
    assert handle_from_json(run["handle"]) == JobHandle("slurm", "4242")
    assert handle_from_json({"backend": "ssh"}) is None and handle_from_json([1]) is None


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
    st, started, _ = be.wait_then_submit("w1", sub("w2"), wait_s=0.2)
    assert st.state == protocol.RUNNING and started is None and not Path(wd, "runs", "w2").exists()
    be.cancel("w1", grace_s=5)
    st, started, _ = be.wait_then_submit("w1", sub("w2"), wait_s=5)
    assert st.state == protocol.CANCELLED and isinstance(started, Launch) and started.name == "w2"
    assert protocol.read_json(Path(wd, "runs", "w2", "run.json"))["drafter"] == "/x"
    st, again, _ = be.wait_then_submit("w1", sub("w2"), wait_s=5)
    assert st.state == protocol.CANCELLED and isinstance(again, RunExists)
    assert be.wait_then_submit("nope", sub("w3"), wait_s=0.2) == (None, None, None)
    lost = Path(wd, "runs", "w4")
    lost.mkdir()
    (lost / "status.json").write_text('{"state": "running", "pgid": 1}')
    st, started, _ = be.wait_then_submit("w4", sub("w3"), wait_s=0.2)
    assert st.state == protocol.LOST and started is None and not Path(wd, "runs", "w3").exists()
    assert be.wait_then_submit("w2", sub("w3"), wait_s=30)[0].state == protocol.SUCCEEDED


def _same_files(pulled: Path, remote: Path) -> list[str]:
    names = sorted(f.name for f in remote.iterdir() if f.name in protocol.RUN_FILES and f.is_file()
                   and not f.is_symlink())
    assert sorted(f.name for f in pulled.iterdir() if f.name in protocol.RUN_FILES) == names
    for n in names:
        assert (pulled / n).read_bytes() == (remote / n).read_bytes(), n
    return names


@pytest.mark.parametrize("cls", [SSHBackend, _TwoTrips])
def test_wait_then_submit_brings_the_ended_runs_files_when_asked(tmp_path, monkeypatch, cls):
    """pull=True: the ended run's contract files come back in the same answer (SSH), byte for byte, into
    runs/<host>/<run>/ (its .follow.json kept); a file that is a link stays out, as in a pull; files larger in
    all than PULL_MAX_BYTES do not come (None: pulled on their own), nor do any without pull=True or from a
    backend without WAIT_THEN_SUBMIT. The launch is the same either way."""
    from orchestrator.backends import ssh
    from orchestrator.rundir.registry import FOLLOW_JSON, local_run_dir
    host, t, wd = synced_local(tmp_path / "work")
    be = cls(host, t)

    def sub(name, lines="3"):
        return Submission(name, ["dummy", "--lines", lines, "--interval-s", "0.02"], sys.executable, gpus="none",
                          run_json={"drafter": "/x"})
    be.submit(sub("p1"))
    follow = local_run_dir(host.name, "p1") / FOLLOW_JSON
    assert follow.exists()  # the launch wrote it
    st, started, pulled = be.wait_then_submit("p1", sub("p2"), wait_s=30, pull=True)
    assert st.state == protocol.SUCCEEDED and isinstance(started, Launch) and started.name == "p2"
    if cls is _TwoTrips:
        assert pulled is None
        assert be.wait_then_submit("p2", None, wait_s=30, pull=True)[1:] == (None, None)
        return
    assert pulled is not None and pulled.path == local_run_dir(host.name, "p1") and follow.exists()
    names = _same_files(pulled.path, Path(wd, "runs", "p1"))
    assert pulled.files == names and {"run.json", "status.json", "eval.log", "events.jsonl"} <= set(names)
    # eval.log a link on the host: left out, as the streamed pull leaves it out
    be.wait_then_submit("p2", sub("p3"), wait_s=30)
    log = Path(wd, "runs", "p2", "eval.log")
    log.rename(log.with_name("elsewhere.log"))
    log.symlink_to(log.with_name("elsewhere.log"))
    st, started, pulled = be.wait_then_submit("p2", sub("p3", "1"), wait_s=30, pull=True)
    assert isinstance(started, RunExists) and pulled is not None and "eval.log" not in pulled.files
    _same_files(pulled.path, Path(wd, "runs", "p2"))
    # too large in all: nothing comes; without pull=True neither
    monkeypatch.setattr(ssh, "PULL_MAX_BYTES", 64)
    st, started, pulled = be.wait_then_submit("p3", sub("p4"), wait_s=30, pull=True)
    assert st.state == protocol.SUCCEEDED and isinstance(started, Launch) and pulled is None
    assert not local_run_dir(host.name, "p3").joinpath("status.json").exists()
    monkeypatch.setattr(ssh, "PULL_MAX_BYTES", 4 << 20)
    st, started, pulled = be.wait_then_submit("p4", sub("p5"), wait_s=30)
    assert isinstance(started, Launch) and pulled is None
    # nothing to start (a slot's last run): the long poll that sees the end still brings the files
    st, started, pulled = be.wait_then_submit("p5", None, wait_s=30, pull=True)
    assert st.state == protocol.SUCCEEDED and started is None and pulled is not None
    names = sorted(p.name for p in Path(wd, "runs").iterdir() if p.name.startswith("p"))
    assert names == ["p1", "p2", "p3", "p4", "p5"]
    assert "results.json" in _same_files(pulled.path, Path(wd, "runs", "p5"))
    st, started, pulled = be.wait_then_submit("p5", None, wait_s=30)
    assert st.state == protocol.SUCCEEDED and (started, pulled) == (None, None)


def test_files_that_came_incomplete_are_not_installed(tmp_path):
    """install_pulled: a tar without one of the files the host listed (tar could not read it), a damaged
    tar, or one with a name outside the contract: None, and nothing is written in runs/ here."""
    import io
    import tarfile

    from orchestrator.rundir.pull import install_pulled
    from orchestrator.rundir.registry import local_run_dir

    def tar_of(files: dict) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()
    good = {"status.json": b'{"state": "succeeded"}', "eval.log": b"x\n"}
    assert install_pulled("h", "r1", tar_of(good), ["status.json"]) is None  # more than listed
    assert install_pulled("h", "r1", tar_of(good), ["status.json", "eval.log", "results.json"]) is None
    assert install_pulled("h", "r1", tar_of(good)[:700], ["status.json", "eval.log"]) is None
    assert install_pulled("h", "r1", tar_of({**good, "../x": b"1"}), ["status.json", "eval.log", "../x"]) is None
    assert not local_run_dir("h", "r1").exists()
    res = install_pulled("h", "r1", tar_of(good), ["eval.log", "status.json"])
    assert res is not None and res.files == ["eval.log", "status.json"]
    assert (res.path / "eval.log").read_bytes() == b"x\n"


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
    from orchestrator.rundir.follow import FrameParser
    host, t, wd = synced_local(tmp_path / "work")
    be = get_backend(host, t)
    be.submit(Submission("b2", ["dummy", "--lines", "3", "--interval-s", "0"], sys.executable, gpus="none"))
    wait_status(Path(wd, "runs", "b2"))
    p = t.popen(be.stream_command("b2", python=sys.executable, log_offset=0, events_offset=0))
    out, _ = p.communicate(timeout=60)
    frames = FrameParser().feed(out)
    assert frames[-1].tag == "D" and b"prompt3" in b"".join(f.data for f in frames if f.tag == "L")
