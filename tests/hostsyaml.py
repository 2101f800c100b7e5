"""hosts.yaml text in tests (test_inventory, test_slurm_jobs): parse it, or get the one-line error it gives."""
from __future__ import annotations

import textwrap

import pytest

from orchestrator.errors import EXIT_BAD_INPUT, ConfigError
from orchestrator.hosts.inventory import parse_inventory


def parse(text: str):
    """The inventory of `text` (dedented), as if read from a file named hosts.yaml."""
    return parse_inventory(textwrap.dedent(text), "hosts.yaml")


def error_of(text: str) -> str:
    """The ConfigError that parsing `text` raises: one line, exit 3 (EXIT_BAD_INPUT)."""
    with pytest.raises(ConfigError) as ei:
        parse(text)
    assert ei.value.exit_code == EXIT_BAD_INPUT
    assert "\n" not in str(ei.value)  # one line
    return str(ei.value)
