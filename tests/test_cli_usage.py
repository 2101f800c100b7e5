"""Usage errors and help through the CLI runner: bad usage is exit 3 everywhere (2 means partial), names that
look like options are refused, mistyped flags and commands get a "did you mean", every command and option
is described, and the bash completion script works in a real bash."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from orchestrator.errors import ConfigError
from orchestrator.hosts.inventory import parse_inventory
from reval import cli
from reval.cli.argparsing import subparsers
from tests.runtools import reval

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("bad", [["--num-prompts", "abc"], ["--max-blocks", "x"], ["--payload", "bogus"],
                                 ["--num-prompts", "0"], ["--give-up-s", "-1"], ["--give-up-s", "nan"],
                                 ["--name", "-rf"], ["--name=-rf"], ["--name=--help"]])
def test_bad_option_values_after_host_exit_3_and_leave_nothing(here, capsys, bad):
    rc, out, err = reval(capsys, "run", "local", "--payload", "dummy", *bad)
    assert rc == 3, (bad, err)
    assert "Traceback" not in err and "sync" not in out  # refused before anything was synced or launched
    assert not (here / ".reval").exists() and not (here / "runs").exists()


def test_run_names_and_host_names_that_look_like_options_are_refused(here, capsys):
    from remote_payload.contract import protocol
    for name in ("-rf", "--help", "-"):
        with pytest.raises(protocol.ProtocolError, match="not starting with '.' or '-'"):
            protocol.validate_run_name(name)
    assert protocol.default_run_name("/models/-rf").startswith("rf-")  # a default name never starts with '-'
    for host in ("-rf", "--help"):
        with pytest.raises(ConfigError, match=f"host name '{host}' is not allowed"):
            parse_inventory(f"hosts:\n  '{host}': {{address: 127.0.0.2}}\n", "h.yaml")
        (here / "h.yaml").write_text(f"hosts:\n  '{host}': {{address: 127.0.0.2}}\n")
        rc, _, err = reval(capsys, "-i", "h.yaml", "ls")
        assert rc == 3 and f"h.yaml line 2: host name '{host}' is not allowed" in err


def test_did_you_mean_on_mistyped_flags_and_commands(here, capsys):
    rc, _, err = reval(capsys, "run", "local", "--drafer", "/x")
    assert rc == 3 and "did you mean: --drafer -> --drafter" in err
    assert "payload arguments go after --" not in err  # that hint is for words nothing is close to
    rc, _, err = reval(capsys, "run", "local", "--payload", "dummy", "--zzzz")
    assert rc == 3 and "payload arguments go after --" in err
    rc, _, err = reval(capsys, "lss")
    assert rc == 3 and "did you mean 'ls'?" in err
    rc, _, err = reval(capsys, "hosts", "check", "--jsn")
    assert rc == 3 and "--jsn -> --json" in err


def test_unknown_option_of_a_subcommand_prints_that_subcommands_usage(here, capsys):
    rc, _, err = reval(capsys, "ls", "--bogus-flag")
    assert rc == 3
    assert err.startswith("usage: reval ls ") and "reval ls: error: unrecognized arguments: --bogus-flag" in err
    assert "COMMAND ..." not in err


def test_usage_errors_name_no_internal_names(here, capsys):
    rc, _, err = reval(capsys, "run")
    assert rc == 3 and "the following arguments are required: HOST\n" in err
    assert "extra" not in err and "host," not in err


def test_every_command_and_option_is_described_with_its_default():
    parser = cli.build_parser()
    for prog, sp in subparsers(parser):
        if not any(isinstance(a, argparse._SubParsersAction) for a in sp._actions) or prog == "reval hosts":
            assert sp.description, f"{prog} has no description"
        for a in sp._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.help == argparse.SUPPRESS:
                continue
            assert a.help, f"{prog} {a.dest} has no help text"
        text = sp.format_help()
        for a in sp._actions:
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) \
                    and not isinstance(a, argparse._HelpAction):
                line = " ".join(text.split())  # help wraps
                assert "default" in line, f"{prog} {a.option_strings[0]} does not show its default"
    run_help = dict(subparsers(parser))["reval run"].format_help()
    assert "exit codes:" in run_help and "101 still running" in run_help and "3 bad input" in run_help
    assert "relative path" in run_help  # how paths resolve on local vs remote hosts
    assert "(default: 120.0)" in " ".join(run_help.split())


def test_payload_version():
    p = subprocess.run([sys.executable, "-m", "remote_payload", "--version"], check=False, capture_output=True,
                       text=True,
                       cwd=REPO, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("remote_payload 0.") and "protocol 1" in p.stdout


def test_bash_completion_in_a_real_bash(here, capsys):
    rc, script, _ = reval(capsys, "completion", "bash")
    assert rc == 0 and "complete -o default -F _reval reval" in script
    (here / "reval.bash").write_text(script)
    (here / "hosts.yaml").write_text("hosts:\n  gpu1: {address: 127.0.0.2}\n  gpu2: {address: 127.0.0.3}\n"
                                     "groups:\n  boxes: [gpu1, gpu2]\n")
    (here / "other").mkdir()
    (here / "other" / "cluster.yaml").write_text("hosts:\n  hpc: {address: 127.0.0.4, slurm: {gpus: 1}}\n")
    driver = f"""
source {here}/reval.bash
reval() {{ PYTHONPATH={REPO} {sys.executable} -m reval "$@"; }}
comp() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _reval; echo "${{COMPREPLY[*]}}"; }}
comp reval l
comp reval run --drafte
comp reval run gpu1 --payload ""
comp reval hosts c
comp reval -i hosts.yaml run ""
comp reval -i other/cluster.yaml run ""
comp reval --inventory=other/cluster.yaml sweep --hosts ""
comp reval completion ""
comp reval sweep --hosts b
"""
    p = subprocess.run(["bash", "-c", driver], check=False, capture_output=True, text=True, timeout=120, cwd=here)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["logs ls", "--drafter", "eval dummy", "check", "gpu1 gpu2 local boxes",
                                     "hpc local", "hpc local", "bash zsh", "boxes"]  # -i FILE: that file's hosts
    rc, zsh, _ = reval(capsys, "completion", "zsh")
    assert zsh.startswith("#compdef reval") and "bashcompinit" in zsh and "_reval()" in zsh


def test_hosts_lists_what_a_cluster_job_asks_for_not_a_gpu_setting(here, capsys):
    (here / "h.yaml").write_text("hosts:\n  box: {address: 127.0.0.2, gpus: [0, 1]}\n"
                                 "  hpc: {address: 127.0.0.3, slurm: {partition: gpu, gpus: 2}}\n"
                                 "  hpc2: {address: 127.0.0.4, slurm: {gres: 'gpu:a100:1'}}\n")
    rc, out, err = reval(capsys, "-i", "h.yaml", "hosts")
    assert rc == 0, err
    cells = [[c.strip() for c in line.split("│")] for line in out.splitlines() if line.count("│") > 2]
    rows = {c[1]: " ".join(c) for c in cells}  # cell 1: the host name (rich table, wrapped cells joined)
    assert "0,1" in rows["box"] and "Slurm, per job --gpus=2 on gpu" in rows["hpc"]
    assert "Slurm, per job --gres=gpu:a100:1" in rows["hpc2"] and "auto" not in rows["hpc"] + rows["hpc2"]


def test_every_help_fits_100_columns(capsys, monkeypatch):
    """Issue 32 item 6: the commands' descriptions and examples were printed as written, lines up to 786
    columns; every --help now fits a 100-column terminal (an example's comment folded under its `#`)."""
    from reval.cli import build_parser
    from reval.cli.argparsing import subparsers
    monkeypatch.setenv("COLUMNS", "100")
    root = build_parser()
    for prog, parser in [("reval", root), *subparsers(root)]:
        text = parser.format_help()
        long = [line for line in text.splitlines() if len(line) > 100]
        assert not long, (prog, long)
    lines = root.format_help().splitlines()
    i = next(i for i, line in enumerate(lines) if line.lstrip().startswith("reval hosts check gpu-boxes"))
    col = lines[i].index("#")
    assert lines[i + 1][:col].strip() == "" and lines[i + 1][col:col + 1].strip()  # folded under its `#`
