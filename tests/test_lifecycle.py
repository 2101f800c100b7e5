"""Lifecycle semantics (issue 10 breaks 7, 8, 9) through the CLI on the local host: one state vocabulary
(a SIGKILLed group is `lost` in the final line too), the same `reval run` again re-attaches to the run it
started, and bad input is refused on the host before anything exists — after any exit 3 nothing is left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remote_payload.contract import protocol
from tests.runtools import group_members, reval, wait_lines

ROOT = Path(__file__).resolve().parents[1]
SLOW = ["--", "--lines", "60", "--interval-s", "0.05"]


def remote_runs(here: Path) -> list[str]:
    d = here / ".reval/local/runs"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# -- break 7: one vocabulary --------------------------------------------------------------------------------
def test_sigkilled_group_reads_lost_everywhere_final_line_included(here, capsys):
    rc, _, _ = reval(capsys, "run", "local", "--payload", "dummy", "--name", "sk", "--detach", "--",
                     "--lines", "2000", "--interval-s", "0.05")
    assert rc == 101
    run_dir = here / ".reval/local/runs/sk"
    wait_lines(run_dir / "eval.log", 4)
    pgid = protocol.read_json(run_dir / "status.json")["pgid"]
    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    rc, out, _ = reval(capsys, "status", "sk")
    assert rc == 1 and "sk on local: lost" in out
    rc, out, err = reval(capsys, "logs", "sk", "-f")
    assert rc == 1
    final = [ln for ln in err.splitlines() if ln.startswith(("lost", "failed", "done", "cancelled"))]
    assert final and final[0].startswith("lost    sk"), err
    assert "exit None" not in err and "failed" not in final[0]


# -- break 8: the same command again re-attaches --------------------------------------------------------
def _controller(here: Path, *argv: str) -> subprocess.Popen:
    code = "import sys; from reval.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *argv], cwd=here, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _sigkill_controller_mid_run(here: Path, argv: list[str]) -> str:
    p = _controller(here, *argv)
    deadline = time.monotonic() + 120
    follows = []
    while time.monotonic() < deadline:
        follows = [f for f in (here / "runs/local").glob("*/.follow.json")] if (here / "runs/local").is_dir() else []
        if follows and json.loads(follows[0].read_text() or "{}").get("log_offset", 0) > 0:
            break
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the controller only (its own session); the run has another
    p.wait()
    assert follows, "the controller never started following"
    return follows[0].parent.name


@pytest.mark.parametrize("named", [False, True])
def test_run_again_after_a_sigkilled_controller_reattaches(here, capsys, named):
    argv = ["run", "local", "--payload", "dummy", *(["--name", "again"] if named else []), *SLOW]
    name = _sigkill_controller_mid_run(here, argv)
    assert remote_runs(here) == [name]
    rc, out, err = reval(capsys, *argv)
    assert rc == 0, err
    assert f"attach  {name} on local" in out and "launch  " not in out
    assert remote_runs(here) == [name]  # no second eval
    assert "done    " + name in out
    pulled = (here / "runs/local" / name / "eval.log").read_text().splitlines()
    assert sum("[60/60] prompt60" in ln for ln in pulled) == 1
    # seen to its end now: the same command again is a new run (or, named, a clear refusal)
    rc, out, err = reval(capsys, *argv)
    if named:
        assert rc == 3 and "already used" in err and "that run succeeded" in err and "reval rm local/again" in err
    else:
        assert rc == 0 and len(remote_runs(here)) == 2


# -- break 9: bad input refused before launching; nothing left after any exit 3 -----------------------------
def test_bad_paths_refused_on_the_host_before_anything_exists(here, capsys, tmp_path):
    target, cache = tmp_path / "t", tmp_path / "c"
    target.mkdir()
    cache.mkdir()
    rc, _, err = reval(capsys, "run", "local", "--drafter", str(tmp_path / "nope"), "--target", str(target),
                       "--cache", str(cache), "--name", "bp")
    assert rc == 3 and "drafter checkpoint" in err and "does not exist" in err
    assert "Traceback" not in err
    assert remote_runs(here) == [] and not (here / "runs/local/bp").exists()
    drafter = tmp_path / "d"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"\0" * 8)
    rc, _, err = reval(capsys, "run", "local", "--drafter", str(drafter), "--target", str(target),
                       "--cache", str(cache), "--name", "bp")
    assert rc == 3 and "config.json: missing field 'hidden_size'" in err
    assert remote_runs(here) == [] and not (here / "runs/local/bp").exists()


def test_fc_layers_missing_from_the_cache_refused_before_launch(here, capsys, tmp_path, trained_fixtures):
    root = Path(trained_fixtures)
    paths = json.loads((root / "fixtures.json").read_text())["paths"]
    src = root / paths["cache"]
    cache = tmp_path / "other-layers"
    cache.mkdir()
    meta = json.loads((src / "cache.json").read_text())
    meta["layer_ids"] = [i + 100 for i in meta["layer_ids"]]
    (cache / "cache.json").write_text(json.dumps(meta))
    for p in meta["prompts"]:
        (cache / p["file"]).symlink_to(src / p["file"])
    rc, _, err = reval(capsys, "run", "local", "--drafter", str(root / paths["drafter_good"]), "--target",
                       str(root / paths["target"]), "--cache", str(cache), "--name", "mm")
    assert rc == 3 and "without layers" in err and "Re-extract" in err
    assert remote_runs(here) == [] and not (here / "runs/local/mm").exists()
    rc, _, err = reval(capsys, "run", "local", "--drafter", str(root / paths["drafter_good"]), "--target",
                       str(tmp_path), "--cache", str(src), "--name", "mm")
    assert rc == 3 and "has neither model.safetensors.index.json nor model.safetensors" in err
    assert remote_runs(here) == [] and not (here / "runs/local/mm").exists()


def test_payload_exit_3_after_launch_leaves_nothing_and_frees_the_name(here, capsys):
    argv = ["run", "local", "--payload", "dummy", "--name", "b3", "--", "--lines", "1", "--interval-s", "0",
            "--exit-code", "3"]
    rc, _, err = reval(capsys, *argv)
    assert rc == 3 and "failed  b3 on local (exit 3)" in err
    assert remote_runs(here) == [] and not (here / "runs/local/b3").exists()
    rc, _, err = reval(capsys, *argv)  # the name is free again
    assert rc == 3 and "already used" not in err


def test_sweep_bad_input_leaves_no_sweep_state(here, capsys, tmp_path):
    ck = tmp_path / "ckpts"
    (ck / "step-1").mkdir(parents=True)
    (ck / "step-1" / "w.bin").write_bytes(b"x")
    base = ["sweep", "--payload", "dummy", "--sweep-dir", str(here / "sw")]
    rc, _, err = reval(capsys, *base, "--checkpoints", f"{ck}/step-*", "--hosts", "no-such-group")
    assert rc == 3 and "unknown host or group 'no-such-group'" in err
    assert not (here / "sw").exists()
    rc, _, err = reval(capsys, *base, "--checkpoints", f"{ck}/nothing-*", "--hosts", "local")
    assert rc == 3 and "nothing matches" in err
    assert not (here / "sw").exists()
    (here / "sw").mkdir()  # an existing sweep dir keeps what it had, and gets no sweep.json or lock
    rc, _, _ = reval(capsys, *base, "--checkpoints", f"{ck}/nothing-*", "--hosts", "local")
    assert rc == 3 and list((here / "sw").iterdir()) == []
