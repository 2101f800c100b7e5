"""Trust breaks (issue 19): what a command decides from a host must not be fooled by the host's clock or by
a run folder that is a symbolic link. Real sshd hosts and real runs (the dummy payload stands in for the eval)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.runtools import reval

FAST = ["--", "--lines", "2", "--interval-s", "0"]
DAY = 86400


# --- clock skew: ages come from the host's own clock ---------------------------------------------------------
def skewed_python(root: Path) -> tuple[Path, Path]:
    """(interpreter, skew file): a host interpreter whose clock is off by the seconds in the skew file, read by
    every python it starts (time.time, gmtime, localtime, strftime: what the wrapper and the probes read). The
    system clock is not touched: the seam is the host's `python` in hosts.yaml (venv mode python), as a host
    whose clock is wrong would run it."""
    site = root / "skewsite"
    site.mkdir(parents=True)
    skew = root / "skew_s"
    skew.write_text("0\n")
    (site / "sitecustomize.py").write_text(
        "import time as _t\n"
        f"_skew = float(open({str(skew)!r}).read())\n"
        "_time, _gm, _lt, _sf = _t.time, _t.gmtime, _t.localtime, _t.strftime\n"
        "_t.time = lambda: _time() + _skew\n"
        "_t.time_ns = lambda: int(_t.time() * 1e9)\n"
        "_t.gmtime = lambda s=None: _gm(_t.time() if s is None else s)\n"
        "_t.localtime = lambda s=None: _lt(_t.time() if s is None else s)\n"
        "_t.strftime = lambda f, tt=None: _sf(f, _t.localtime() if tt is None else tt)\n")
    py = root / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py, skew


@pytest.mark.ssh
def test_prune_ages_runs_by_the_hosts_own_clock(ssh_hosts, here, capsys):
    py, skew = skewed_python(here / "host-python")
    c = ssh_hosts(1, extra={"python": str(py)})
    inv = str(c.inventory_path)
    runs = c.hosts[0].workdir / "runs"

    def run_at(name: str, skew_s: float) -> None:
        skew.write_text(f"{skew_s}\n")
        rc, out, err = reval(capsys, "-i", inv, "run", "ssh1", "--payload", "dummy", "--name", name, *FAST)
        assert rc == 0 and f"done    {name} succeeded" in out, err

    # the host's clock is 25 years behind: a run that succeeded seconds ago is not 25 years old
    run_at("ancient", -25 * 365 * DAY)
    assert '"finished_at": "200' in (runs / "ancient/status.json").read_text()  # the host's clock wrote it
    rc, out, err = reval(capsys, "-i", inv, "prune", "--older-than", "14d", "--yes")
    assert rc == 0 and "nothing to remove" in out, (out, err)
    assert "skipped ssh1/ancient (succeeded)" in err and "not pruned by age" in err, err
    assert (runs / "ancient").is_dir() and (here / "runs/ssh1/ancient").is_dir()

    # 30 days behind: a run that ended 20 days ago by the host's clock goes, one that just ended stays
    run_at("old", -50 * DAY)
    run_at("fresh", -30 * DAY)
    rc, out, err = reval(capsys, "-i", inv, "prune", "--older-than", "14d", "--yes")
    assert rc == 0 and "remove  ssh1/old (succeeded)" in out and "removed 1 run(s)" in out, (out, err)
    assert sorted(p.name for p in runs.iterdir()) == ["ancient", "fresh"]
    assert (here / "runs/ssh1/fresh").is_dir() and not (here / "runs/ssh1/old").exists()

    # the host's clock went back: a run that ended after the host's "now" has no age to judge
    skew.write_text(f"{-60 * DAY}\n")
    rc, out, err = reval(capsys, "-i", inv, "prune", "--older-than", "14d", "--yes")
    assert rc == 0 and "nothing to remove" in out, (out, err)
    assert "skipped ssh1/fresh (succeeded): it ended at" in err and "after the host's clock now" in err, err

    # the host's clock is right again: `fresh` did end 30 days ago; a finish time from the wrong clock (2001)
    # is not 25 years of age
    skew.write_text("0\n")
    rc, out, err = reval(capsys, "-i", inv, "prune", "--older-than", "14d", "--yes")
    assert rc == 0 and "remove  ssh1/fresh (succeeded)" in out and "removed 1 run(s)" in out, (out, err)
    assert "skipped ssh1/ancient (succeeded)" in err and "written by a wrong clock" in err, err
    assert [p.name for p in runs.iterdir()] == ["ancient"] and (here / "runs/ssh1/ancient").is_dir()


# --- a run folder that is a symbolic link: refused by every command, never followed -------------------------
def assert_refused(rc: int, out: str, err: str, path: str) -> None:
    """Exit 3, one line naming `path` as a link, nothing of what it points to shown, no traceback."""
    assert rc == 3, (rc, out, err)
    assert f"{path} is a symbolic link" in err and "Traceback" not in err, err
    assert "SECRET" not in out + err


@pytest.mark.ssh
def test_a_symlinked_run_folder_is_refused_by_every_command(ssh_hosts, here, capsys):
    c = ssh_hosts(1)
    inv = ["-i", str(c.inventory_path)]
    runs = c.hosts[0].workdir / "runs"
    rc, _, err = reval(capsys, *inv, "run", "ssh1", "--payload", "dummy", "--name", "real", *FAST)
    assert rc == 0, err
    elsewhere = c.hosts[0].workdir / "elsewhere"  # files outside runs/ that look like a run
    elsewhere.mkdir()
    for f in ("run.json", "status.json", "events.jsonl", "results.json"):
        (elsewhere / f).write_bytes((runs / "real" / f).read_bytes())
    (elsewhere / "eval.log").write_text("SECRET line\n")
    (runs / "evil").symlink_to(elsewhere)
    evil = str(runs / "evil")

    for argv in (["status", "ssh1/evil"], ["status", "ssh1/evil", "--json"], ["logs", "ssh1/evil"],
                 ["logs", "ssh1/evil", "-f"], ["logs", "ssh1/evil", "--tail", "1"], ["pull", "ssh1/evil"],
                 ["kill", "ssh1/evil", "--grace-s", "0"], ["rm", "ssh1/evil", "--yes"],
                 ["rm", "ssh1/evil", "--local-only", "--yes"], ["compare", "ssh1/evil", "--pull"]):
        rc, out, err = reval(capsys, *inv, *argv)
        assert_refused(rc, out, err, evil)
    assert (runs / "evil").is_symlink() and (elsewhere / "eval.log").exists()  # nothing removed
    assert not (here / "runs/ssh1/evil").exists()  # nothing pulled
    rc, out, err = reval(capsys, *inv, "ls")  # not a run: not listed
    assert rc == 0 and "real" in out and "evil" not in out, err
    rc, out, err = reval(capsys, *inv, "pull", "--all")
    assert rc == 0 and "ssh1/real" in out and "evil" not in out and not (here / "runs/ssh1/evil").exists(), err

    # a run's eval.log that is a link: logs refuses it; pull leaves it out (never a symlinked file)
    log = runs / "real/eval.log"
    log.unlink()
    log.symlink_to(elsewhere / "eval.log")
    for argv in (["logs", "ssh1/real"], ["logs", "ssh1/real", "--json"], ["logs", "ssh1/real", "-f"]):
        rc, out, err = reval(capsys, *inv, *argv)
        assert_refused(rc, out, err, str(log))
    rc, out, err = reval(capsys, *inv, "pull", "ssh1/real")
    assert rc == 0 and not (here / "runs/ssh1/real/eval.log").exists(), err
    rc, out, err = reval(capsys, *inv, "status", "ssh1/real")
    assert rc == 0 and "succeeded" in out, err

    # a run reached through `..`
    for argv in (["status", "ssh1/.."], ["compare", "ssh1/.."], ["compare", "../real"]):
        rc, out, err = reval(capsys, *inv, *argv)
        assert rc == 3 and "invalid run name '..'" in err, (argv, rc, err)


def test_a_symlinked_local_copy_is_refused_by_compare_load_and_rm(here, capsys):
    import reval as api
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--name", "real", *FAST)
    assert rc == 0, err
    real = here / "runs/local/real"
    alias = here / "runs/local/alias"
    alias.symlink_to(real)  # inside runs/: it used to load (and remove) the run it points to
    for argv in (["compare", "local/alias"], ["compare", "alias"], ["compare", "runs/local/alias"],
                 ["rm", "local/alias", "--yes"], ["rm", "local/alias", "--local-only", "--yes"]):
        rc, out, err = reval(capsys, *argv)
        assert_refused(rc, out, err, "runs/local/alias")
    with pytest.raises(api.Error) as e:
        api.load("runs/local/alias")
    assert e.value.exit_code == 3 and "runs/local/alias is a symbolic link" in str(e.value)
    assert (real / "results.json").is_file() and alias.is_symlink()  # nothing removed through the link
    rc, out, err = reval(capsys, "compare", "local/real")
    assert rc == 0 and "real" in out, err
