"""sync_payload / ensure_env / `reval sync` against real sshd + real rsync (and the tar fallback)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError, RemoteCommandError
from orchestrator.hosts.environment import build_venv_script, ensure_env, provision, venv_key
from orchestrator.hosts.inventory import load_inventory
from orchestrator.hosts.sync import (
    MANIFEST,
    Manifest,
    build_manifest,
    diff_manifests,
    is_excluded,
    payload_files,
    rsync_argv,
    safe_rel,
    sync_payload,
)
from orchestrator.hosts.transport import get_transport
from reval import cli
from tests.samples import make_wheel

HOSTILE = ["a b.py", "q'uote.py", 'dq"uote.py', "semi;colon.py", "$(touch PWNED).py", "`id`.py", "-dash.py"]
EXCLUDED = [".git/config", ".env", ".env.local", "runs/r1/eval.log", "__pycache__/x.cpython-311.pyc",
            "ckpt.pt", "model.safetensors", "w.bin", "sub/__pycache__/y.pyc"]


def make_source(root: Path) -> Path:
    src = root / "remote_payload"
    (src / "sub" / "deep").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "main.py").write_text("print('hi')\n")
    (src / "sub" / "mod.py").write_text("X = 1\n")
    (src / "sub" / "deep" / "gone.py").write_text("Y = 2\n")
    for name in HOSTILE:
        (src / name).write_text(f"# {name}\n")
    for rel in EXCLUDED:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("secret\n")
    os.symlink("/etc/hostname", src / "link.py")
    return src


def remote_tree(payload_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(payload_dir)): p.read_bytes() for p in sorted(payload_dir.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


# --- pure ---------------------------------------------------------------------------------------------------
def test_exclusions_and_safe_paths():
    for rel in EXCLUDED:
        assert is_excluded(rel), rel
    for rel in ["main.py", "sub/mod.py", "envy.py", "runs.py", "binary.py"]:
        assert not is_excluded(rel), rel
    assert all(safe_rel(r) for r in ["a", "a/b", "a b/c'd"])
    assert not any(safe_rel(r) for r in ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a"])


def test_diff_ignores_hostile_remote_manifest_entries():
    local = Manifest({"a.py": "1", "b.py": "2"}, "h")
    changed, deleted = diff_manifests(local, {"files": {"a.py": "1", "b.py": "0", "old.py": "9",
                                                        "../../etc/passwd": "x", "/abs": "y"}})
    assert changed == ["b.py"] and deleted == ["old.py"]
    assert diff_manifests(local, None) == (["a.py", "b.py"], [])
    assert diff_manifests(local, {"files": "garbage"}) == (["a.py", "b.py"], [])


def test_rsync_argv_keeps_rsh_as_one_argument():
    argv = rsync_argv(["ssh", "-o", "ControlPath=/tmp/a b", "-p", "2222"], "/src/", "h:/d e/", delete=True)
    assert argv[argv.index("-e") + 1] == "ssh -o 'ControlPath=/tmp/a b' -p 2222"
    assert "--delete" in argv and "--exclude=.env*" in argv and argv[-2:] == ["/src/", "h:/d e/"]


def test_manifest_hash_changes_with_content_and_requirements(tmp_path):
    src = make_source(tmp_path)
    m1 = build_manifest(payload_files(src, ["numpy"]))
    assert "remote_payload/main.py" in m1.files and "requirements.txt" in m1.files
    assert not any(is_excluded(r) for r in m1.files) and "remote_payload/link.py" not in m1.files
    assert build_manifest(payload_files(src, ["numpy"])).hash == m1.hash
    assert build_manifest(payload_files(src, ["numpy", "six"])).hash != m1.hash
    (src / "main.py").write_text("print('ho')\n")
    assert build_manifest(payload_files(src, ["numpy"])).hash != m1.hash


# --- real sshd + rsync ------------------------------------------------------------------------------------
@pytest.mark.ssh
@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_sync_ships_only_changes_deletes_and_excludes(ssh_hosts, tmp_path, method):
    c = ssh_hosts(1, extra={"workdir": str(tmp_path / "work dir 'q' $(x)")})
    host = load_inventory(c.inventory_path).get("ssh1")
    t = get_transport(host)
    src = make_source(tmp_path / "local")
    reqs = ["numpy"]
    payload = tmp_path / "work dir 'q' $(x)" / "payload"

    first = sync_payload(t, host, method=method, source=src, requirements=reqs)
    local = {rel: (c.read_bytes() if isinstance(c, Path) else c) for rel, c in payload_files(src, reqs).items()}
    assert first.method == method and first.files_changed == len(local) == first.files_total
    tree = remote_tree(payload)
    assert {k: v for k, v in tree.items() if k != MANIFEST} == local  # hostile names arrive verbatim
    assert json.loads(tree[MANIFEST])["hash"] == first.manifest_hash
    assert not any(is_excluded(k) for k in tree) and "remote_payload/link.py" not in tree
    assert not list(tmp_path.rglob("PWNED")) and not Path("PWNED").exists() and not (Path.home() / "PWNED").exists()

    again = sync_payload(t, host, method=method, source=src, requirements=reqs)
    assert (again.files_changed, again.files_deleted, again.method, again.bytes) == (0, 0, "none", 0)

    (src / "sub" / "mod.py").write_text("X = 2\n")  # same size: must still travel
    one = sync_payload(t, host, method=method, source=src, requirements=reqs)
    assert (one.files_changed, one.files_deleted, one.bytes) == (1, 0, 6)
    assert (payload / "remote_payload/sub/mod.py").read_text() == "X = 2\n"

    (src / "sub" / "deep" / "gone.py").unlink()
    (src / "sub" / "deep").rmdir()
    (src / "a b.py").unlink()
    gone = sync_payload(t, host, method=method, source=src, requirements=reqs)
    assert (gone.files_changed, gone.files_deleted) == (0, 2)
    assert not (payload / "remote_payload/sub/deep").exists() and not (payload / "remote_payload/a b.py").exists()
    # the payload's own __pycache__ on the host is neither shipped nor deleted
    (payload / "remote_payload/__pycache__").mkdir(exist_ok=True)
    (src / "main.py").write_text("print('changed')\n")
    sync_payload(t, host, method=method, source=src, requirements=reqs)
    assert (payload / "remote_payload/__pycache__").is_dir()


@pytest.mark.ssh
def test_rsync_and_tar_produce_the_same_tree(ssh_hosts, tmp_path):
    c = ssh_hosts(2)
    inv = load_inventory(c.inventory_path)
    src = make_source(tmp_path / "local")
    for name, method in (("ssh1", "rsync"), ("ssh2", "tar")):
        h = inv.get(name)
        sync_payload(get_transport(h), h, method=method, source=src, requirements=["six"])
    assert remote_tree(c.hosts[0].workdir / "payload") == remote_tree(c.hosts[1].workdir / "payload")


@pytest.mark.ssh
def test_missing_manifest_means_full_resend(ssh_hosts, tmp_path):
    c = ssh_hosts(1)
    h = load_inventory(c.inventory_path).get("ssh1")
    src = make_source(tmp_path / "local")
    first = sync_payload(get_transport(h), h, source=src, requirements=[])
    (c.hosts[0].workdir / "payload" / MANIFEST).unlink()  # an interrupted sync
    again = sync_payload(get_transport(h), h, source=src, requirements=[])
    assert again.files_changed == first.files_changed and again.method == "rsync"


@pytest.mark.ssh
def test_env_forces_tar_fallback(ssh_hosts, tmp_path, monkeypatch):
    c = ssh_hosts(1)
    h = load_inventory(c.inventory_path).get("ssh1")
    monkeypatch.setenv("REVAL_SYNC_METHOD", "tar")
    assert sync_payload(get_transport(h), h, source=make_source(tmp_path), requirements=[]).method == "tar"
    monkeypatch.setenv("REVAL_SYNC_METHOD", "ftp")
    (tmp_path / "remote_payload" / "main.py").write_text("x")
    with pytest.raises(ConfigError, match="unknown sync method 'ftp'"):
        sync_payload(get_transport(h), h, source=tmp_path / "remote_payload", requirements=[])


def test_sync_local_host_real_payload(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inv = load_inventory()  # built-in local host: .reval/local under the cwd
    h = inv.get("local")
    r = sync_payload(get_transport(h), h)
    assert r.files_changed == r.files_total > 3
    assert (tmp_path / ".reval/local/payload/remote_payload/contract/protocol.py").is_file()
    assert "torch" in (tmp_path / ".reval/local/payload/requirements.txt").read_text()
    # runs import the synced copy from <workdir>/payload
    out = subprocess.run([sys.executable, "-c", "import remote_payload.contract.protocol as p; print(p.__file__)"],
                         cwd=tmp_path / ".reval/local/payload", capture_output=True, text=True, check=False)
    assert out.stdout.startswith(str(tmp_path))
    assert ensure_env(get_transport(h), h).python == sys.executable


# --- `reval sync` over a group ------------------------------------------------------------------------------
@pytest.mark.ssh
def test_sync_group_one_host_down_others_complete(ssh_hosts, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    c = ssh_hosts(3)
    c.stop(1)
    rc = cli.main(["-i", str(c.inventory_path), "sync", "cluster"])
    out = capsys.readouterr().out
    assert rc == 2
    assert "ssh2  FAILED" in out and "Connection refused" in out and "failed: ssh2" in out
    for i in (0, 2):
        assert (c.hosts[i].workdir / "payload" / MANIFEST).is_file()
        assert f"ssh{i + 1}  payload: " in out
    assert not (c.hosts[1].workdir / "payload").exists()
    for i in (0, 2):
        c.stop(i)
    assert cli.main(["-i", str(c.inventory_path), "sync", "cluster"]) == 4


@pytest.mark.ssh
def test_sync_python_mode_missing_module_is_reported(ssh_hosts, capsys):
    c = ssh_hosts(1)
    h = load_inventory(c.inventory_path).get("ssh1")
    with pytest.raises(ConfigError, match="cannot import no_such_mod_xyz"):
        ensure_env(get_transport(h), h, requirements=["no-such-mod-xyz>=1"])
    assert ensure_env(get_transport(h), h, requirements=["json"]).reused


# --- managed venv, offline, from a wheelhouse ---------------------------------------------------------------
@pytest.mark.ssh
@pytest.mark.slow
def test_managed_venv_built_offline_from_wheelhouse_then_reused(ssh_hosts, tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels)
    c = ssh_hosts(1, extra={"venv": {"mode": "managed", "wheelhouse": str(wheels)}})
    h = load_inventory(c.inventory_path).get("ssh1")
    t = get_transport(h)
    with pytest.raises(RemoteCommandError, match="build venv"):
        ensure_env(t, h, requirements=["revaltiny==2.0"])  # not in the wheelhouse: fails, no marker
    venvs = c.hosts[0].workdir / "venvs"
    assert not list(venvs.glob("*/.reval-ready"))

    built = ensure_env(t, h, requirements=["revaltiny==1.0"])
    assert not built.reused and built.method == "venv" and built.python == f"{venvs}/{built.key}/bin/python"
    assert (venvs / built.key / ".reval-ready").is_file()
    assert (c.hosts[0].workdir / "wheelhouse" / "revaltiny-1.0-py3-none-any.whl").is_file()
    out = t.run(f"{built.python} -c 'import revaltiny; print(revaltiny.VERSION)'").stdout
    assert out.strip() == "1.0"
    again = ensure_env(t, h, requirements=["revaltiny==1.0"])
    assert again.reused and again.key == built.key
    # provision (one combined probe round trip) agrees with sync_payload + ensure_env done separately
    synced, env = provision(t, h, requirements=["revaltiny==1.0"])
    assert env == again and synced.manifest_hash == sync_payload(t, h, requirements=["revaltiny==1.0"]).manifest_hash
    synced, env = provision(t, h, requirements=["revaltiny==1.0"])
    assert synced.method == "none" and env.reused


def test_venv_key_and_build_script_are_pure():
    k = venv_key(["torch>=2.4"], "3.11.7", False)
    assert k == venv_key(["torch>=2.4"], "3.11.7", False)
    assert len({k, venv_key(["torch>=2.5"], "3.11.7", False), venv_key(["torch>=2.4"], "3.12.1", False),
                venv_key(["torch>=2.4"], "3.11.7", True)}) == 4
    uv = build_venv_script("python3", "/w/venvs/k", "/w/locks/l", uv="/usr/bin/uv", system_site_packages=True,
                           find_links="/w/wheel house", install=True)
    assert "/usr/bin/uv venv -q --system-site-packages --python python3 /w/venvs/k" in uv
    assert "--no-index --find-links '/w/wheel house'" in uv
    lines = uv.strip().splitlines()
    assert lines[-1].startswith("printf") and ".reval-ready" in lines[-1]  # marker LAST
    pip = build_venv_script("python3", "/w/venvs/k", "/w/l", uv=None, system_site_packages=False,
                            find_links=None, install=True)
    assert "python3 -m venv /w/venvs/k" in pip and "-m pip install" in pip and "--system-site" not in pip
