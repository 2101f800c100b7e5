"""One root exception for the laptop half. Expected errors print one line (with the fix) and exit
with a documented code; anything else keeps its traceback.

Exit codes (README): 0 ok · 1 an eval failed · 2 partial · 3 bad input or config · 4 host unreachable ·
101 still running · 102 run not found · 103 cancelled.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_EVAL_FAILED = 1
EXIT_PARTIAL = 2
EXIT_BAD_INPUT = 3
EXIT_UNREACHABLE = 4
EXIT_STILL_RUNNING = 101
EXIT_NOT_FOUND = 102
EXIT_CANCELLED = 103


class RevalError(Exception):
    """An expected failure: `str(e)` is the one line the user sees; `hint` is the fix (may be multi-line)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None,
                 more: list[RevalError] | None = None):
        super().__init__(message)
        self.hint = hint
        self.more = list(more or [])  # further problems found in the same pass (all of a file's errors at once)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(RevalError):
    exit_code = EXIT_BAD_INPUT


class RunExists(ConfigError):
    """The run name is already used on the host (the launch claimed nothing)."""


class HostUnreachable(RevalError):
    exit_code = EXIT_UNREACHABLE


class HostKeyError(RevalError):
    """Unknown or changed host key: never retried, always names the file/line to fix."""
    exit_code = EXIT_UNREACHABLE


class RunNotFound(RevalError):
    exit_code = EXIT_NOT_FOUND


class EvalFailed(RevalError):
    exit_code = EXIT_EVAL_FAILED


class RemoteCommandError(RevalError):
    """A remote command exited non-zero: carries the command, exit code and the last lines of stderr."""

    exit_code = EXIT_EVAL_FAILED

    def __init__(self, host: str, command: str, returncode: int, stderr: str = "", stdout: str = ""):
        tail = "\n".join((stderr or "").strip().splitlines()[-8:])
        short = command if len(command) <= 160 else command[:157] + "..."
        super().__init__(f"{host}: command failed (exit {returncode}): {short}" + (f"\n{tail}" if tail else ""))
        self.host, self.command, self.returncode, self.stderr, self.stdout = host, command, returncode, stderr, stdout
