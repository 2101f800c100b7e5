"""`make test` is the whole suite: a test that skips there fails instead, with its skip reason, so that a
machine without the real components (sshd, Slurm, Chromium, the private network namespace, a dev dependency)
can never report success with part of the suite left out. Loaded by tests/conftest.py.

`make test-fast` is the explicit opt-out (REVAL_ALLOW_SKIPS=1): there a skip stays a skip. The same variable
lets a hand-run subset skip what it cannot run here. An expected failure (xfail) is not a skip."""
from __future__ import annotations

import os

import pytest

ALLOW_ENV = "REVAL_ALLOW_SKIPS"
FIX = (f"a skip fails the whole suite: install what is missing (scripts/install-system-deps, as root) and run "
       f"it under scripts/netns-run (make test does both), or allow skips with {ALLOW_ENV}=1 (make test-fast)")


def skips_allowed() -> bool:
    return os.environ.get(ALLOW_ENV) == "1"


def missing(reason: str) -> None:
    """A real component is missing in the middle of a test: fail saying so, or, with skips allowed, go on
    (the caller leaves out the part that needs it)."""
    if not skips_allowed():
        pytest.fail(f"{reason} -- {FIX}", pytrace=False)


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _as_failure(rep) -> None:
    rep.outcome = "failed"
    rep.longrepr = f"skipped: {_skip_reason(rep.longrepr)}\n{FIX}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    if rep.skipped and not hasattr(rep, "wasxfail") and not skips_allowed():
        _as_failure(rep)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    rep = (yield).get_result()
    if rep.skipped and not skips_allowed():  # a whole module skipped (allow_module_level, importorskip)
        _as_failure(rep)
