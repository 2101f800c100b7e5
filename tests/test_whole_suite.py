"""`make test` is whole: the Debian packages are installed or named (scripts/install-system-deps), and a
skipped test fails the suite (tests/whole.py) unless REVAL_ALLOW_SKIPS=1 (make test-fast). Both are checked
here without installing anything: the script runs with a PATH of our own (a fake `apt-get` and `id`), the
hook in a pytest run of its own on a few tiny tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import whole

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install-system-deps"

TINY = '''
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("/usr/sbin/sshd is missing")

@pytest.mark.skipif(True, reason="chromium is not installed")
def test_skipif():
    pass

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False
'''


def run_pytest(folder: Path, allow: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != whole.ALLOW_ENV}
    env["PYTHONPATH"] = str(REPO)
    if allow is not None:
        env[whole.ALLOW_ENV] = allow
    (folder / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.whole", "-p", "no:cacheprovider", "-q",
                           "-ra", "--rootdir", str(folder), "-c", str(folder / "pytest.ini"), str(folder)],
                          check=False, cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_the_suite_unless_skips_are_allowed(tmp_path):
    (tmp_path / "test_tiny.py").write_text(TINY)
    p = run_pytest(tmp_path, None)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in p.stdout, p.stdout  # a skip in setup: an error
    assert "/usr/sbin/sshd is missing" in p.stdout and "chromium is not installed" in p.stdout
    assert whole.ALLOW_ENV in p.stdout and "install-system-deps" in p.stdout
    for allow in ("0", ""):  # only "1" opts out
        assert run_pytest(tmp_path, allow).returncode == 1
    p = run_pytest(tmp_path, "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in p.stdout, p.stdout


def test_a_skipped_module_fails_the_suite(tmp_path):
    (tmp_path / "test_mod.py").write_text('import pytest\npytest.skip("no slurmctld", allow_module_level=True)\n')
    (tmp_path / "test_other.py").write_text("def test_passes():\n    pass\n")
    p = run_pytest(tmp_path, None)
    assert p.returncode != 0 and "no slurmctld" in p.stdout, p.stdout + p.stderr
    assert run_pytest(tmp_path, "1").returncode == 0


def test_missing_fails_a_test_midway_unless_skips_are_allowed(monkeypatch):
    monkeypatch.delenv(whole.ALLOW_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match="chromium is not installed"):
        whole.missing("chromium is not installed")
    monkeypatch.setenv(whole.ALLOW_ENV, "1")
    whole.missing("chromium is not installed")  # returns: the caller leaves that part out


# --- scripts/install-system-deps -------------------------------------------------------------------------------
def fake_path(tmp_path: Path, *, without: set[str], uid: int = 0, apt_rc: int = 0,
              apt_installs: bool = True) -> dict:
    """An environment whose PATH holds the script's commands (links to the real ones) except `without`, an
    `id` that says `uid`, and an `apt-get` that logs its arguments, exits `apt_rc` and, when `apt_installs`,
    makes `install` put the missing commands in place (links to the real ones)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pairs = [line.split() for line in subprocess.run([str(SCRIPT), "--list"], capture_output=True, text=True,
                                                      check=True).stdout.splitlines()]
    real = {cmd: shutil.which(cmd, path=os.environ["PATH"] + ":/usr/sbin:/sbin") for cmd, _ in pairs}
    if not all(real.values()):  # a failure under make test (tests/whole.py), which installs them first
        pytest.skip(f"not installed here: {sorted(c for c, p in real.items() if not p)} (scripts/install-system-deps)")
    for cmd, path in real.items():
        if cmd not in without:
            (bin_dir / cmd).symlink_to(path)
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    ln = shutil.which("ln")
    links = "".join(f"{ln} -sf {real[c]} {bin_dir / c}\n" for c in sorted(without)) if apt_installs else ""
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "apt.log"}\n'
                                     f'[ "$1" = install ] && {{\n{links}:\n}}\nexit {apt_rc}\n')
    for f in ("id", "apt-get"):
        (bin_dir / f).chmod(0o755)
    return {"PATH": str(bin_dir)}


def install(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], check=False, env=env, capture_output=True, text=True, timeout=60)


def apt_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_nothing_missing_installs_nothing(tmp_path):
    p = install(fake_path(tmp_path, without=set()))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert apt_calls(tmp_path) == []


def test_check_names_the_missing_packages_and_installs_nothing(tmp_path):
    p = install(fake_path(tmp_path, without={"rsync", "chromium"}), "--check")
    assert p.returncode == 1 and "missing Debian packages: rsync chromium" in p.stderr, p.stderr
    assert apt_calls(tmp_path) == []


def test_not_root_fails_naming_the_packages(tmp_path):
    p = install(fake_path(tmp_path, without={"sbatch", "sacct"}, uid=1000))
    assert p.returncode == 1, p.stderr
    assert "missing Debian packages: slurm-client (not root" in p.stderr  # one package for both commands
    assert apt_calls(tmp_path) == []


def test_root_installs_what_is_missing(tmp_path):
    env = fake_path(tmp_path, without={"rsync", "ssh-keygen"})
    p = install(env)
    assert p.returncode == 0, p.stderr
    assert apt_calls(tmp_path) == ["update -q", "install -y -q --no-install-recommends openssh-client rsync"]
    assert install(env, "--check").returncode == 0


@pytest.mark.parametrize("apt_rc, apt_installs, why", [(100, False, "apt-get failed"),
                                                      (0, False, "still missing after apt-get install")])
def test_apt_that_does_not_deliver_fails_naming_the_packages(tmp_path, apt_rc, apt_installs, why):
    p = install(fake_path(tmp_path, without={"chromium"}, apt_rc=apt_rc, apt_installs=apt_installs))
    assert p.returncode == 1 and f"missing Debian packages: chromium ({why})" in p.stderr, p.stderr


def test_make_test_installs_them_and_test_fast_allows_skips():
    p = subprocess.run(["make", "-n", "test", "test-fast"], cwd=REPO, capture_output=True, text=True,
                       check=True, env={**os.environ, "MAKEFLAGS": ""})
    lines = p.stdout.splitlines()
    assert "scripts/install-system-deps" in lines
    assert lines.index("scripts/install-system-deps") < next(i for i, x in enumerate(lines) if "netns-run" in x)
    assert any(x.startswith(f"{whole.ALLOW_ENV}=1 ") and "not ssh" in x for x in lines)
    assert not any(whole.ALLOW_ENV in x for x in lines if "netns-run" in x)
    assert "scripts/install-system-deps" in (REPO / ".ci" / "run").read_text()
