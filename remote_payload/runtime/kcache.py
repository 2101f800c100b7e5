"""Where a payload process keeps its compiled kernels (stdlib only: set before torch is imported).

A fresh GPU host pays for compiling its kernels: cuDNN's attention kernel through CUDA's JIT, the eval's CUDA C
passes through NVRTC (eval/rtc.py), extract's Triton kernels, torch's own run-time compiled kernels
(docs/benchmarks.md: a fresh host's first `eval` ~1.25x the warm median). Each library keeps them in a per-user
folder by default (~/.nv/ComputeCache, ~/.triton/cache, ...), which every node of a cluster fills again for
itself. In a venv (the managed venv `reval sync` builds; on a cluster it is shared by the nodes) they live in the
venv instead, `<venv>/var/reval/kernel-caches/<cache>/`, so the first run on any node (or
`python -m remote_payload warm`, `reval sync HOST --warm`) fills them once for all.

`setup(environ)` sets every variable of `CACHES` that is unset to its folder under the root: REVAL_KERNEL_CACHES
(a folder) when set, else the venv's. A value the user set wins (that variable is left alone);
REVAL_KERNEL_CACHES=user keeps the libraries' per-user defaults; outside a venv they are kept too. A root that
cannot be written (a read-only shared venv) is no error: the per-user caches are used and `setup` returns a note
saying so. It records its outcome in REVAL_KERNEL_CACHES (the root, or `user`), so a child process (the
wrapper's command) keeps it without asking again.

Two nodes filling one cache at once: every writer of these caches writes a file whole under a temporary name and
renames it into place (rtc.write_cached; Triton's and Inductor's caches do the same), so a reader sees the old
file, the new one or none, never half of one. CUDA's JIT cache is the driver's own format, with the driver's own
handling of writers at once (not checked here across nodes): where it misbehaves on a shared filesystem, a
node-local CUDA_CACHE_PATH keeps the rest shared.
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

ROOT_ENV = "REVAL_KERNEL_CACHES"
USER = "user"  # ROOT_ENV's value for the libraries' own per-user caches
VENV_SUBDIR = ("var", "reval", "kernel-caches")
# (variable, its folder under the root, whose cache it is)
CACHES = (("CUDA_CACHE_PATH", "cuda", "CUDA's JIT (PTX -> GPU code; cuDNN's run-time compiled kernels)"),
          ("REVAL_KERNEL_CACHE", "reval", "reval's CUDA C passes (NVRTC cubins, eval/rtc.py)"),
          ("TRITON_CACHE_DIR", "triton", "Triton's compiled kernels (extract's decode steps)"),
          ("TORCHINDUCTOR_CACHE_DIR", "inductor", "torch.compile's (extract --compile)"),
          ("PYTORCH_KERNEL_CACHE_PATH", "torch", "torch's own run-time compiled (jiterator) kernels"))
VARIABLES = tuple(v for v, _, _ in CACHES)


def in_venv(prefix: str | None = None, base_prefix: str | None = None) -> bool:
    return (prefix or sys.prefix) != (base_prefix or sys.base_prefix)


def venv_root(prefix: str | None = None, base_prefix: str | None = None) -> Path | None:
    """`<venv>/var/reval/kernel-caches` for the running interpreter's venv; None outside a venv."""
    if not in_venv(prefix, base_prefix):
        return None
    return Path(prefix or sys.prefix, *VENV_SUBDIR)


def paths(root: str | os.PathLike) -> dict[str, str]:
    """Each variable of `CACHES` -> its folder under `root`."""
    return {var: str(Path(root, sub)) for var, sub, _ in CACHES}


def writable(path: Path) -> bool:
    """`path` can be made and written by this user: it, or its nearest existing ancestor, is a folder this user
    may write into (nothing is created here: a process that never compiles leaves no trace)."""
    p = Path(os.path.abspath(path))
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)


def resolve(environ: MutableMapping[str, str], prefix: str | None = None,
            base_prefix: str | None = None) -> tuple[Path | None, str | None]:
    """(the root the caches go under or None for the per-user ones, a note when a root was refused)."""
    asked = environ.get(ROOT_ENV, "").strip()
    if asked == USER:
        return None, None
    root = Path(os.path.abspath(os.path.expanduser(asked))) if asked else venv_root(prefix, base_prefix)
    if root is None:
        return None, None
    unset = [(var, Path(root, sub)) for var, sub, _ in CACHES if not environ.get(var)]
    bad = next((str(p) for _var, p in unset if not writable(p)), None)
    if bad is not None:
        how = f"{ROOT_ENV}={asked}" if asked else "the venv's kernel caches"
        return None, (f"note: {how}: {bad} cannot be written; the kernels are cached per user instead "
                      f"(~/.nv, ~/.triton, ~/.cache); set {ROOT_ENV}=DIR to a folder you can write to")
    return root, None


def setup(environ: MutableMapping[str, str] | None = None, prefix: str | None = None,
          base_prefix: str | None = None) -> str | None:
    """Default the kernel caches' variables in `environ` (os.environ) as the module's doc says; returns the
    note to show when the caches fell back to the per-user ones, else None. Does nothing a second time (the
    outcome is in REVAL_KERNEL_CACHES, and every variable is then set)."""
    environ = os.environ if environ is None else environ
    root, note = resolve(environ, prefix, base_prefix)
    if root is not None:
        for var, path in paths(root).items():
            if not environ.get(var):
                environ[var] = path
    environ[ROOT_ENV] = str(root) if root is not None else USER
    return note


def describe(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """One line per cache: where it is now (for `warm` and the docs' examples)."""
    environ = os.environ if environ is None else environ
    return [f"{var}={environ.get(var) or '(the library default, per user)'}  {what}" for var, _, what in CACHES]
