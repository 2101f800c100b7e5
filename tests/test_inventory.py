"""hosts.yaml loading: every bad input is one ConfigError line naming file, line and the fix (exit 3)."""
from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.hosts.inventory import load_inventory, parse_inventory
from tests.hostsyaml import error_of, parse

REPO = Path(__file__).resolve().parents[1]


def test_full_host_parses_into_dataclass():
    inv = parse("""
        hosts:
          gpu1:
            address: gpu1.example.internal
            user: eval
            port: 2200
            identity_file: ~/.ssh/id_ed25519
            proxy_jump: bastion.example.internal
            host_key: accept-new
            workdir: /scratch/reval
            python: python3.11
            venv: {mode: managed, system_site_packages: true, wheelhouse: wheels}
            gpus: [0, 1]
            env: {HF_HUB_OFFLINE: 1, DEBUG: true}
            tags: [h100, fast]
          alias:
            ssh: ct129
        groups:
          boxes: [gpu1, alias]
    """)
    h = inv.get("gpu1")
    assert (h.address, h.user, h.port, h.host_key_policy, h.gpus) == (
        "gpu1.example.internal", "eval", 2200, "accept-new", "0,1")
    assert h.venv.system_site_packages is True and h.venv.wheelhouse.endswith("/wheels")
    assert h.env == {"HF_HUB_OFFLINE": "1", "DEBUG": "true"} and h.tags == ["h100", "fast"]
    assert inv.get("alias").address == "ct129" and not inv.get("alias").is_local
    assert [x.name for x in inv.resolve("boxes")] == ["gpu1", "alias"]
    assert [x.name for x in inv.resolve("alias")] == ["alias"]
    assert inv.get("local").is_local  # the built-in local host is always there


@pytest.mark.parametrize("text, pattern", [
    ("""
     hosts:
       ct129:
         ssh: ct129
         wrkdir: /x
     """, r"line 5: unknown key 'wrkdir' in host 'ct129' — did you mean 'workdir'\?"),
    ("""
     hosts:
       a: {ssh: a}
       b: {ssh: b}
       a: {ssh: c}
     """, r"line 5: duplicate hosts key 'a' \(first at line 3\)"),
    ("""
     hosts:
       a: {ssh: a}
     groups:
       g: [a, bb]
     """, r"line 5: group 'g' names unknown host 'bb'"),
    ("""
     hosts:
       a:
         ssh: a
         port: twenty
     """, r"line 5: host 'a': port must be a port number, got str 'twenty'"),
    ("""
     hosts:
       a:
         workdir: /x
     """, r"line 3: host 'a': missing `ssh:` .* or `address:`"),
    ("""
     hosts:
       a:
         ssh: a
         venv: {mode: managd}
     """, r"line 5: host 'a': venv.mode 'managd' is not one of managed, python — did you mean 'managed'\?"),
    ("""
     hosts:
       a:
         ssh: a
         venv: {system_site_package: true}
     """, r"line 5: unknown key 'system_site_package' in host 'a' venv — did you mean 'system_site_packages'\?"),
    ("""
     hosts:
       a: {ssh: a, host_key: yes}
     """, r"line 3: host 'a': host_key must be strict or accept-new, got bool True"),
    ("""
     hosts:
       a: {ssh: a, gpus: "0,x"}
     """, r"line 3: host 'a': gpus '0,x' must be auto, none, or GPU indices"),
    ("""
     hosts:
       a: {ssh: a, python: current}
     """, r"line 3: host 'a': python: current .* only a local host"),
    ("""
     hostz:
       a: {ssh: a}
     """, r"line 2: unknown top-level key 'hostz' — did you mean 'hosts'\?"),
    ("""
     hosts:
       a: {ssh: a, address: b}
     """, r"line 3: host 'a': give either `ssh:` .* or `address:`, not both"),
    ("""
     hosts:
       a: {ssh: a
     """, r"hosts.yaml line \d+: not valid YAML"),
])
def test_bad_inventory_is_one_line_with_file_and_line(text, pattern):
    e = error_of(text)
    assert str(e).startswith("hosts.yaml ")
    assert re.search(pattern, str(e)), str(e)


def test_unknown_host_or_group_on_the_command_line_suggests():
    inv = parse("""
        hosts:
          ct129: {ssh: ct129}
        groups:
          gpu-boxes: [ct129]
    """)
    with pytest.raises(ConfigError, match=r"unknown host or group 'gpu-box' .* did you mean 'gpu-boxes'\?"):
        inv.resolve("gpu-box")
    with pytest.raises(ConfigError, match="did you mean 'ct129'"):
        inv.get("ct12")


def test_default_lookup_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_HOSTS", raising=False)
    inv = load_inventory()
    assert inv.path is None and list(inv.hosts) == ["local"]
    assert inv.get("local").python == sys.executable and inv.get("local").venv.mode == "python"
    (tmp_path / "hosts.yaml").write_text("hosts:\n  cwd: {ssh: cwd}\n")
    assert "cwd" in load_inventory().hosts
    (tmp_path / "env.yaml").write_text("hosts:\n  fromenv: {ssh: e}\n")
    monkeypatch.setenv("REVAL_HOSTS", str(tmp_path / "env.yaml"))
    assert "fromenv" in load_inventory().hosts
    (tmp_path / "flag.yaml").write_text("hosts:\n  fromflag: {ssh: f}\n")
    assert "fromflag" in load_inventory(tmp_path / "flag.yaml").hosts
    with pytest.raises(ConfigError, match="inventory .*missing.yaml not found"):
        load_inventory(tmp_path / "missing.yaml")


def test_shipped_hosts_yaml_and_its_commented_examples_are_valid():
    text = (REPO / "hosts.yaml").read_text()
    inv = parse_inventory(text, "hosts.yaml")
    assert list(inv.hosts) == ["local"] and inv.get("local").is_local
    # Uncomment the examples: they must load too, and name placeholder hosts only.
    uncommented = "\n".join(re.sub(r"^(\s*)# (?=[a-z0-9_-]+:|  )", r"\1", line) for line in text.splitlines())
    inv = parse_inventory(uncommented, "hosts.yaml")
    assert {"gpu1", "gpu2", "gpu3"} <= set(inv.hosts) and inv.groups == {"gpu-boxes": ["gpu1", "gpu2"]}
    for h in inv.hosts.values():
        assert h.is_local or h.address == h.name or h.address.endswith(".example.internal")


def test_host_names_and_venv_path_are_checked(tmp_path):
    from orchestrator.errors import ConfigError
    from orchestrator.hosts.inventory import parse_inventory
    with pytest.raises(ConfigError, match=r"hosts.yaml line 2: host name 'my box' is not allowed"):
        parse_inventory("hosts:\n  my box: {address: a.example.internal}\n")
    with pytest.raises(ConfigError, match=r"line 2: host '\.\./x'|host name '\.\./x'"):
        parse_inventory("hosts:\n  ../x: {address: a.example.internal}\n")
    with pytest.raises(ConfigError, match="venv.path '~/venvs' must be an absolute path"):
        parse_inventory("hosts:\n  gpu1:\n    address: a.example.internal\n    venv: {path: ~/venvs}\n")
    inv = parse_inventory("hosts:\n  gpu-1.a_b:\n    address: a.example.internal\n    venv: {path: /opt/v}\n")
    assert inv.get("gpu-1.a_b").venv.path == "/opt/v"


def test_non_utf8_inventory_is_one_line_exit_3(tmp_path, capsys, monkeypatch):
    from reval import cli
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.yaml").write_bytes(b"hosts:\n  a: {address: 127.0.0.2}\n  b: {address: caf\xe9}\n")
    with pytest.raises(ConfigError, match=r"hosts.yaml line 3: not UTF-8 text \(byte 0xe9\)"):
        load_inventory("hosts.yaml")
    rc = cli.main(["ls"])
    err = capsys.readouterr().err
    assert rc == 3 and "Traceback" not in err and err.startswith("error: hosts.yaml line 3: not UTF-8")


def test_every_problem_of_the_file_is_reported_at_once(tmp_path, capsys, monkeypatch):
    from reval import cli
    monkeypatch.chdir(tmp_path)
    text = textwrap.dedent("""\
        hosts:
          a: {address: 127.0.0.2, hostnmae: x}
          b: {address: 5}
          '-rf': {address: 127.0.0.4}
          c: {address: 127.0.0.5, gpus: 5, venv: {mode: conda}}
          d: {address: 127.0.0.6}
        groups:
          g: [a, b, nope]
        """)
    (tmp_path / "hosts.yaml").write_text(text)
    with pytest.raises(ConfigError) as ei:
        parse_inventory(text, "hosts.yaml")
    lines = [str(e) for e in (ei.value, *ei.value.more)]
    assert lines[0].startswith("hosts.yaml line 2: unknown key 'hostnmae' in host 'a'")
    assert lines[1:] == [
        "hosts.yaml line 3: host 'b': address must be a hostname or IP, got int 5",
        ("hosts.yaml line 4: host name '-rf' is not allowed: use 1-64 characters from A-Z a-z 0-9 . _ - "
        "(not starting with '.' or '-')"),
        "hosts.yaml line 5: host 'c': gpus 5 is not a list",
        "hosts.yaml line 5: host 'c': venv.mode 'conda' is not one of managed, python",
        "hosts.yaml line 8: group 'g' names unknown host 'nope'",
    ]
    assert "gpus: [5]" in ei.value.more[2].hint and "gpus: auto" in ei.value.more[2].hint
    rc = cli.main(["ls"])
    err = capsys.readouterr().err
    assert rc == 3 and err.count("error: hosts.yaml line") == 6 and "Traceback" not in err


def test_a_group_name_is_held_to_the_host_name_alphabet(tmp_path):
    """Group names are command arguments and go into the completion script's word list: '$(...)' or '-x' there
    is one line naming it, like a host name."""
    for bad in ("$(touch pwned)", "-x", "a b"):
        text = f"hosts:\n  a: {{address: 127.0.0.2}}\ngroups:\n  '{bad}': [a]\n"
        with pytest.raises(ConfigError, match=r"hosts.yaml line 4: group name .* is not allowed"):
            parse_inventory(text, "hosts.yaml")
    assert parse_inventory("hosts:\n  a: {address: 127.0.0.2}\ngroups:\n  ok.g-1: [a]\n", "hosts.yaml").groups == \
        {"ok.g-1": ["a"]}
