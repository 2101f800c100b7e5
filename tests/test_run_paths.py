"""`reval run` path arguments: relative paths mean the controller's cwd on the local host and are refused
(with the fix) on a remote host, where they would silently resolve against the payload folder. The rule is the
API's (reval.check_spec, which reval.submit applies too); `reval run` calls it."""
import pytest

import reval
from orchestrator.errors import ConfigError
from orchestrator.hosts.inventory import Host


def test_local_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = reval.EvalSpec(drafter="d", target="/abs/t", cache="sub/c")
    a = reval.check_spec(Host(name="local", local=True), spec)
    assert (a.drafter, a.target, a.cache_label()) == (str(tmp_path / "d"), "/abs/t", str(tmp_path / "sub" / "c"))
    assert spec.drafter == "d"  # the caller's spec is left as it was
    suites = reval.check_spec(Host(name="local", local=True), reval.EvalSpec(drafter="/d", target="/t",
                                                                             cache=["math=m", "code=/c"]))
    assert [c.text() for c in suites.cache] == [f"math={tmp_path / 'm'}", "code=/c"]  # NAME=PATH: the PATH part


def test_remote_relative_path_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        reval.check_spec(Host(name="gpu1", address="gpu1.example.internal"),
                         reval.EvalSpec(drafter="/ok", target="/t", cache="cache"))
    assert "--cache 'cache' is relative" in str(e.value) and "gpu1" in str(e.value)
    assert e.value.exit_code == 3 and e.value.hint == "e.g. --cache /data/cache"


@pytest.mark.parametrize("argv", [["sweep", "--hosts", "x"], ["bogus"], ["run"], ["compare", "a", "--format", "xls"]])
def test_usage_errors_exit_3_not_2(argv, capsys):
    """argparse's own exit 2 would read as "partial" to cron/CI; bad usage is bad input."""
    from reval.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 3 and "error:" in capsys.readouterr().err


def test_payload_usage_error_exits_3(capsys):
    from remote_payload.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["eval", "--drafter", "x"])
    assert e.value.code == 3 and "--target" in capsys.readouterr().err
