"""`reval run` path arguments: relative paths mean the controller's cwd on the local host and are refused
(with the fix) on a remote host, where they would silently resolve against the payload folder."""
import argparse

import pytest

from orchestrator.commands.run import host_paths
from orchestrator.errors import ConfigError
from orchestrator.inventory import Host


def ns(**kw):
    return argparse.Namespace(**{"drafter": None, "target": None, "cache": None, **kw})


def test_local_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = ns(drafter="d", target="/abs/t", cache="sub/c")
    host_paths(a, Host(name="local", local=True))
    assert (a.drafter, a.target, a.cache) == (str(tmp_path / "d"), "/abs/t", str(tmp_path / "sub" / "c"))


def test_remote_relative_path_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        host_paths(ns(drafter="/ok", cache="cache"), Host(name="gpu1", address="gpu1.example.internal"))
    assert "--cache 'cache' is relative" in str(e.value) and "gpu1" in str(e.value)
    assert e.value.exit_code == 3 and e.value.hint == "e.g. --cache /data/cache"


@pytest.mark.parametrize("argv", [["sweep", "--hosts", "x"], ["bogus"], ["run"], ["compare", "a", "--format", "xls"]])
def test_usage_errors_exit_3_not_2(argv, capsys):
    """argparse's own exit 2 would read as "partial" to cron/CI; bad usage is bad input."""
    from orchestrator.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 3 and "error:" in capsys.readouterr().err


def test_payload_usage_error_exits_3(capsys):
    from remote_payload.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["eval", "--drafter", "x"])
    assert e.value.code == 3 and "--target" in capsys.readouterr().err
