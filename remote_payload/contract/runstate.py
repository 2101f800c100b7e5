"""Which processes are a run's, and the host-side half of `reval status/ls/kill` (stdlib only, self-contained).

A pgid read back from status.json is untrusted: the file may be damaged or hand-edited (`"pgid": 1` would make
`kill -TERM -- -1` signal every process of the user), or left by a wrapper that died unrecorded, its group id
since reused by a stranger. So a process group counts as the run's only when one of its live (non-zombie)
members PROVES it, using what the wrapper recorded at launch:
  - the group leader itself: pid == pgid, and its start time (/proc/<pid>/stat field 22, clock ticks since
    boot) equals status.json's `leader_start`, in the boot status.json's `boot_id` names; or
  - a member whose environment (/proc/<pid>/environ) carries `REVAL_RUN_ID=<status.json run_id>`: the wrapper
    gives a fresh random id to the payload it starts, and every process the payload starts inherits it.
A pgid <= 1, a group of another boot, and a host without /proc prove nothing: such a group is not alive for
us and is never signalled. The check is repeated right before each signal.

Run on a host as a script, fed on stdin, so it works whatever payload version is synced there:
    python3 - probe RUNS_DIR [NAME ...]        one JSON line per run directory (all when no NAME), with the
                                               host's clock (`now`): the one clock that wrote its times
    python3 - wait RUNS_DIR NAME WAIT_S        the same for NAME, as soon as it is no longer running (a long poll)
    python3 - wait-over RUNS_DIR NAME WAIT_S   the same, exiting EXIT_OVER when status.json says the run ended
                                               (succeeded, failed, cancelled; its group given GONE_WAIT_S to
                                               be gone): the sweep's folded script then starts the slot's next
                                               run (any other exit starts nothing)
    python3 - kill RUN_DIR GRACE_S             TERM, wait, KILL the proven group; status `cancelled`
Every line it prints is one JSON object; the controller parses it as JSON (never by pattern).
"""
from __future__ import annotations

import errno
import json
import os
import re
import select
import signal
import stat
import sys
import tempfile
import time

RUN_ID_ENV = "REVAL_RUN_ID"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_JSON_DEPTH = 64  # reval's own files nest about 5 levels; 100,000 is a RecursionError in json (or later)
MAX_STATUS_BYTES = 1 << 20  # a status.json is a few KB


def json_too_deep(obj, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed value nests lists/objects more than `limit` levels (iterative: never recurses)."""
    stack = [(obj, 1)] if type(obj) in (dict, list) else []
    while stack:  # containers only (json's own types): a 30 MB results.json in a fraction of a second
        o, d = stack.pop()
        if d > limit:
            return True
        stack.extend((v, d + 1) for v in (o.values() if type(o) is dict else o) if type(v) in (dict, list))
    return False


def loads(raw):
    """json.loads of an untrusted file's text or bytes; nesting past MAX_JSON_DEPTH is a ValueError too (it was
    a RecursionError, which `except ValueError` misses, here or wherever the value is walked or dumped later)."""
    try:
        obj = json.loads(raw)
        if not json_too_deep(obj):
            return obj
    except RecursionError:
        pass
    raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")


class NotRegularFile(OSError):
    """open_regular's refusal; its text is just "not a regular file" (the callers name the path)."""

    def __str__(self) -> str:
        return "not a regular file"


def open_regular(path, nofollow: bool = False):
    """An untrusted file opened for reading (binary), only when it is a regular file: a FIFO planted where a
    state file or log belongs blocked every reader (`reval ls` hung), a link to /dev/zero never ended a read.
    The open itself never blocks (O_NONBLOCK, which a regular file ignores); anything else is an OSError whose
    strerror says "not a regular file", which callers already treat as an unreadable file. `nofollow`: a
    symbolic link is refused too (ELOOP)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, limit: int = -1) -> bytes:
    """The bytes of an untrusted regular file (open_regular), at most `limit` when given."""
    with open_regular(path) as f:
        return f.read(limit)


class TooLarge(ValueError):
    """read_limited's refusal: "larger than N KiB"."""


def read_limited(path, limit: int) -> bytes:
    """The bytes of an untrusted regular file that may hold at most `limit` (a state file is KBs; a planted one
    may be a sparse 10 GB): never more than limit + 1 read, a larger file is TooLarge."""
    raw = read_regular(path, limit + 1)
    if len(raw) > limit:
        raise TooLarge(f"larger than {limit >> 10} KiB")
    return raw


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start time in clock ticks) of a process, or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
    except (OSError, ValueError):
        return None
    fields = raw[raw.rfind(b")") + 1:].split()  # after comm's closing ")": state ppid pgrp ... (field 3 on)
    try:
        return fields[0].decode(), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """The start time the wrapper records for itself (`leader_start`)."""
    st = proc_stat(pid)
    return st[2] if st else None


def group_members(pgid: int) -> list[int]:
    """The live (non-zombie) pids of process group `pgid`."""
    return _members(pgid)


def _members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def _has_run_id(pid: int, run_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return False
    return f"{RUN_ID_ENV}={run_id}".encode() in env


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def proven_group(status) -> int | None:
    """The run's process group id when a live member proves it is the run's (see above), else None."""
    if not isinstance(status, dict) or not os.path.exists("/proc/self/stat"):
        return None
    pgid, start, run_id = _int(status.get("pgid")), _int(status.get("leader_start")), status.get("run_id")
    if pgid is None or pgid <= 1 or pgid == os.getpgid(0):
        return None
    recorded_boot = status.get("boot_id")
    if not isinstance(recorded_boot, str) or recorded_boot != boot_id():
        return None  # from another boot (or not recorded): that id names nothing of ours
    if start is not None and _leader_lives(pgid, start):  # one /proc read, no walk over every process
        return pgid
    if isinstance(run_id, str) and len(run_id) >= 16 and any(_has_run_id(p, run_id) for p in _members(pgid)):
        return pgid
    return None


def _leader_lives(pgid: int, start: int) -> bool:
    """Whether process `pgid` is a live member of its own group that started at `start` (the recorded leader)."""
    st = proc_stat(pgid)
    return st is not None and st[1] == pgid and st[0] not in ("Z", "X") and st[2] == start


def run_alive(status) -> bool:
    return proven_group(status) is not None


# -- the host-side operations ---------------------------------------------------------------------------------
def _read_status(run_dir: str) -> tuple[object, str | None]:
    """(parsed status.json or None, why it could not be used or None)."""
    try:
        raw = read_regular(os.path.join(run_dir, "status.json"), MAX_STATUS_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable: {e.strerror}"
    if len(raw) > MAX_STATUS_BYTES:
        return None, f"larger than {MAX_STATUS_BYTES >> 20} MiB"
    try:
        st = loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, too deep
        return None, "not valid JSON" + (f" ({e})" if "nested" in str(e) else "")
    if not isinstance(st, dict):
        return None, f"a JSON {type(st).__name__}, not an object"
    return st, None


def _last_event(run_dir: str) -> dict:
    try:
        with open_regular(os.path.join(run_dir, "events.jsonl")) as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read()
    except OSError:
        return {}
    for line in reversed(tail.split(b"\n")[1:] if len(tail) == 65536 else tail.split(b"\n")):
        try:
            ev = loads(line)
        except ValueError:
            continue  # a partial line (being written) or damage (too deep included)
        if isinstance(ev, dict):
            return ev
    return {}


def _kind(run_dir: str) -> str:
    """What the run is (run.json's "kind": extract; eval when it says nothing, as runs made before it did)."""
    try:
        kind = loads(read_regular(os.path.join(run_dir, "run.json"), MAX_STATUS_BYTES)).get("kind")
    except (OSError, ValueError, AttributeError):
        return "eval"
    return kind if isinstance(kind, str) and _NAME.match(kind) else "eval"


def probe(runs_dir: str, names: list[str]) -> list[dict]:
    """One record per run directory (every one when no names). A run folder that is a symbolic link is no run:
    left out of the listing; asked for by name, its record says `refused` (the controller refuses it)."""
    named = bool(names)
    if not names:
        try:
            names = sorted(n for n in os.listdir(runs_dir) if os.path.isdir(os.path.join(runs_dir, n)))
        except OSError:
            return []
    out = []
    for n in names:
        d = os.path.join(runs_dir, n)
        if _NAME.match(n) and not n.startswith(".") and os.path.islink(d) and named:
            out.append({"name": n, "refused": d})
            continue
        if not _NAME.match(n) or n.startswith(".") or not os.path.isdir(d) or os.path.islink(d):
            continue  # not a directory reval made
        st, err = _read_status(d)
        alive = run_alive(st)
        if not alive and isinstance(st, dict) and st.get("state") == "running":
            # the wrapper records the end, then exits: a group found gone after a `running` was read may have
            # written its end in between, so status.json is read again (after the liveness, as stream.py does)
            st, err = _read_status(d)
        out.append({"name": n, "status": st, "status_error": err, "alive": alive,
                    "last_event": _last_event(d), "kind": _kind(d), "now": time.time()})
    return out


def _write_status(run_dir: str, status: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".status.json.", suffix=".tmp", dir=run_dir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(status, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(run_dir, "status.json"))


def _signal(status, sig: int) -> bool:
    """Signal the group only after proving, right now, that it is the run's."""
    pgid = proven_group(status)
    if pgid is None:
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(status, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while run_alive(status):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


def kill(run_dir: str, grace_s: float) -> dict:
    """TERM the proven group, wait grace_s, KILL, confirm; record `cancelled` if the wrapper could not."""
    if os.path.islink(run_dir.rstrip("/")):  # no run: never read or signal through a link
        return {"refused": run_dir, "status": None, "alive": False, "signalled": []}
    st, err = _read_status(run_dir)
    if st is None:
        return {"error": f"status.json {err or 'missing'}", "status": None, "alive": False, "signalled": []}
    signalled = []
    if _signal(st, signal.SIGTERM):
        signalled.append("TERM")
        _signal(st, signal.SIGCONT)  # a stopped process (SIGSTOP) gets its TERM now, not only the KILL
        if not _wait_gone(st, grace_s) and _signal(st, signal.SIGKILL):
            signalled.append("KILL")
            _wait_gone(st, 10.0)
    alive = run_alive(st)
    if not alive:
        time.sleep(0.05)  # the wrapper writes its final state as its last act: let a write in flight land
        st2, _ = _read_status(run_dir)
        st = st2 if st2 is not None else st
        if st.get("state") == "running":  # the wrapper was KILLed (or had died) before it could record the end
            st = {**st, "state": "cancelled", "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "exit_code": 137 if "KILL" in signalled else st.get("exit_code"), "cancelled_by": "reval kill"}
            _write_status(run_dir, st)
    return {"status": st, "alive": alive, "signalled": signalled}


EXIT_OVER = 10  # wait-over: the run ended by status.json's own word (a truncated script exits 0: never this)
ENDED = ("succeeded", "failed", "cancelled")  # protocol.TERMINAL_STATES (this file is stdlib only, self-contained)


def ended(recs: list[dict]) -> bool:
    """Whether a probe's record says the run ended, by its status.json (lost, unknown, missing: not known)."""
    if len(recs) != 1 or "refused" in recs[0]:
        return False
    st = recs[0].get("status")
    return isinstance(st, dict) and st.get("state") in ENDED


GONE_WAIT_S = 5.0  # wait-over: how long an ended run's group may take to be gone before the next run starts
WAIT_TICK_S = 0.1  # a long poll looks again at least this often


def _pause(status: dict, until: float) -> None:
    """Between two looks of a long poll: block on the run's leader (a pidfd, Linux) until it exits or the tick
    is over, so its end wakes the poll at once; without one, sleep the tick. Only a wake-up: the next look
    decides what the run's state is."""
    timeout = max(0.0, min(WAIT_TICK_S, until - time.monotonic()))
    pgid, start = _int(status.get("pgid")), _int(status.get("leader_start"))
    fd = None
    if getattr(os, "pidfd_open", None) and pgid is not None and pgid > 1 and start is not None:
        try:
            fd = os.pidfd_open(pgid)
        except OSError:
            fd = None
    try:
        if fd is not None and _leader_lives(pgid, start):  # still that process (checked once the fd pins it)
            select.select([fd], [], [], timeout)
        else:
            time.sleep(timeout)
    finally:
        if fd is not None:
            os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "probe" and len(argv) >= 2:
        for rec in probe(argv[1], argv[2:]):
            print(json.dumps(rec, default=str))
        return 0
    if len(argv) == 4 and argv[0] in ("wait", "wait-over"):
        end = time.monotonic() + float(argv[3])
        while True:
            recs = probe(argv[1], [argv[2]])
            st = recs[0].get("status") if recs else None
            running = isinstance(st, dict) and st.get("state") == "running" and recs[0].get("alive")
            if not running or time.monotonic() >= end:
                break
            _pause(st, end)
        if argv[0] == "wait-over" and ended(recs) and recs[0].get("alive"):
            # the wrapper records the end, then exits (its GPU locks go with it): the next run starts after that
            until = time.monotonic() + GONE_WAIT_S
            while run_alive(st) and time.monotonic() < until:
                _pause(st, until)
            recs = probe(argv[1], [argv[2]])
        for rec in recs:
            print(json.dumps(rec, default=str))
        return EXIT_OVER if argv[0] == "wait-over" and ended(recs) else 0
    if len(argv) == 3 and argv[0] == "kill":
        print(json.dumps(kill(argv[1], float(argv[2])), default=str))
        return 0
    print(json.dumps({"error": "usage: probe RUNS_DIR [NAME...] | wait[-over] RUNS_DIR NAME WAIT_S"
                               f" | kill RUN_DIR GRACE_S (got {argv!r})"}))
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
