"""Sweep discovery: the checkpoints a `--checkpoints` spec names (listed on their host, or here), each with
its content hash (cached in the ledger by location + size + mtime)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from remote_payload.contract.contenthash import content_hash as local_content_hash

from ..errors import ConfigError, RevalError
from ..hosts.inventory import Inventory
from ..hosts.transport import Transport, get_transport, q
from ..results import compare
from .ledger import Ledger
from .plan import Checkpoint

_PATTERN = re.compile(r"^[A-Za-z0-9._*?\[\]-]+$")


def parse_checkpoint_spec(spec: str, inventory: Inventory) -> tuple[str | None, str, str]:
    """'HOST:/dir/ckpt-*' or a local '/dir/step-*' (or a folder) -> (host or None, dir, basename pattern)."""
    host = None
    if ":" in spec and not spec.startswith(("/", ".")):
        host, spec = spec.split(":", 1)
        inventory.get(host)  # unknown host: error with did-you-mean
        if not spec.startswith("/"):
            raise ConfigError(f"--checkpoints {host}:{spec}: use an absolute path on {host}",
                              hint=f"e.g. --checkpoints '{host}:/root/ckpt/step-*'")
    spec = spec.rstrip("/")
    d, pattern = os.path.split(spec)
    if not pattern or not _PATTERN.match(pattern) or any(c in d for c in "*?["):
        raise ConfigError(f"--checkpoints {spec!r}: the glob may only be in the last part and use "
                          "letters, digits, . _ - * ? [ ]", hint="e.g. --checkpoints 'ct129:/root/ckpt/step-*'")
    return host, d or ".", pattern


# A checkpoint's name becomes its run's name, a file name on the host and an argument of remote commands: a
# sweep takes only names that are plain words of the run-name alphabet, never starting with '-' (an option to
# find/stat/rsync) or '.' (hidden; '..'). Others (`-delete`, `--help`, `a b`, `it's`) are skipped and named.
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,54}$")


def list_script(d: str, pattern: str) -> str:
    """Remote shell: one line per match, `path<TAB>total bytes<TAB>newest mtime`, and `@@SKIP<TAB>name` (its
    unsafe characters as '?') for a name a sweep refuses (pure; GNU find). Every name from the listing reaches
    find/stat only as `./name`, so none is ever parsed as an option or an expression."""
    return (f"cd {q(d)} 2>/dev/null || {{ echo @@NODIR; exit 0; }}; D=$(pwd -P)\n"
            f'for p in ./{pattern}; do [ -e "$p" ] || continue; n=${{p#./}}\n'
            '  case "$n" in [!A-Za-z0-9_]*|*[!A-Za-z0-9._-]*) '
            "printf '@@SKIP\\t%s\\n' \"$(printf '%s' \"$n\" | tr -c 'A-Za-z0-9._ -' '?')\"; continue;; esac\n"
            '  if [ -d "$p" ]; then s=$(find "$p" -type f -printf \'%s %T@\\n\' | '
            "awk '{s+=$1; t=int($2); if (t>m) m=t} END {printf \"%d\\t%d\", s, m}')\n"
            "  else s=$(stat -c '%s\t%Y' -- \"$p\"); fi\n"
            '  printf \'%s\\t%s\\n\' "$D/$n" "$s"\ndone\n')


def hash_command(payload_dir: str, python: str, paths: list[str]) -> str:
    """Remote shell: the payload's `hash` sub-command over `paths` (pure): `<hash><TAB><path>` per path, the
    scheme the eval records in results.json (remote_payload/contract/contenthash.py; `local_content_hash` here)."""
    return (f"cd {q(payload_dir)} && exec {q(python)} -m remote_payload hash -- "
            + " ".join(q(p) for p in paths))


def parse_hashes(out: str) -> dict[str, str]:
    """{path: hash} from hash_command's output (pure)."""
    pairs = (line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    return {p: h for h, p in pairs if h.startswith("sha256-")}


def _local_matches(d: str, pattern: str, skipped: list[str] | None = None) -> list[Checkpoint]:
    out = []
    for p in sorted(Path(d).glob(pattern)):
        if not CHECKPOINT_NAME.match(p.name):
            if skipped is not None:
                skipped.append(p.name)
            continue
        p = p.resolve()
        files = [f for f in p.rglob("*") if f.is_file() and not f.is_symlink()] if p.is_dir() else [p]
        stats = [f.stat() for f in files]
        out.append(Checkpoint(p.name, str(p), None, sum(s.st_size for s in stats),
                              max((int(s.st_mtime) for s in stats), default=0)))
    return out


def discover(specs: list[str], inventory: Inventory, ledger: Ledger, transports: dict[str, Transport],
             skipped: list[str] | None, hasher) -> list[Checkpoint]:
    """Every checkpoint matching the specs, with its content hash (cached in the ledger by size+mtime).
    Names a sweep refuses (CHECKPOINT_NAME) are left out and appended to `skipped`. `hasher(host, paths) ->
    {path: hash}` hashes on a checkpoint's host (Staging.remote_hashes: the payload synced there first)."""
    found: list[Checkpoint] = []
    skipped = [] if skipped is None else skipped
    for spec in specs:
        host, d, pattern = parse_checkpoint_spec(spec, inventory)
        bad: list[str] = []
        if host is None:
            cks = _local_matches(d, pattern, bad)
        else:
            t = transports.get(host) or get_transport(inventory.get(host))
            out = t.run(list_script(d, pattern), timeout_s=300).stdout
            if out.startswith("@@NODIR"):
                raise ConfigError(f"--checkpoints {spec}: no folder {d} on {host}")
            cks = []
            for line in out.splitlines():
                if line.startswith("@@SKIP\t"):
                    bad.append(line[7:])
                    continue
                try:
                    path, size, mtime = line.rsplit("\t", 2)
                    if not CHECKPOINT_NAME.match(os.path.basename(path)):  # too long for a run name
                        bad.append(os.path.basename(path))
                        continue
                    cks.append(Checkpoint(os.path.basename(path), path, host, int(size), int(mtime)))
                except ValueError:
                    raise RevalError(f"--checkpoints {spec}: unexpected listing line from {host}: {line[:120]!r}",
                                     hint=f"check the folder: reval hosts check {host}", exit_code=3) from None
        skipped += bad
        if not cks:
            raise ConfigError(f"--checkpoints {spec}: nothing matches", hint="check the path and the glob")
        todo = []
        for c in cks:
            c.step = compare.checkpoint_step(None, c.name)
            c.content_hash = ledger.cached_hash(c.location, c.size, c.mtime) or ""
            if not c.content_hash:
                todo.append(c)
        if host is None:
            for c in todo:
                c.content_hash = local_content_hash(c.path)
        elif todo:
            hashes = hasher(host, [c.path for c in todo])
            for c in todo:
                if c.path not in hashes:
                    raise ConfigError(f"--checkpoints {spec}: {host} could not hash {c.path}")
                c.content_hash = hashes[c.path]
        for c in todo:
            ledger.remember_hash(c.location, c.size, c.mtime, c.content_hash)
        found += cks
    return found
