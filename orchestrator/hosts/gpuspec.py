"""A run's `--gpus` and a host's run slots: the GPU vocabulary the lifecycle, every backend and the sweep
share (pure). `auto` (the wrapper on the host picks a free GPU and locks it), `none` (CPU), `0,1` (these
indices), `scheduler` (a scheduler assigned them: CUDA_VISIBLE_DEVICES kept as it set it)."""
from __future__ import annotations

import re

from remote_payload.contract import gpus

from ..errors import ConfigError

# `--gpus` value for the wrapper when a scheduler assigned the GPUs (CUDA_VISIBLE_DEVICES kept as is)
GPUS_SCHEDULER = "scheduler"


def normalize_gpus(spec: str | None) -> str:
    """auto | none | '0,1' (validated: indices only); `scheduler` (GPUs assigned by a scheduler) as is."""
    spec = (spec or "auto").strip().lower()
    if spec in ("auto", "none", "cpu", GPUS_SCHEDULER):
        return "none" if spec == "cpu" else spec
    if not re.fullmatch(r"\d+(,\d+)*", spec):
        raise ConfigError(f"--gpus {spec!r}: use auto, none, or GPU indices like 0 or 0,1")
    return spec


def gpu_slots(nvidia_smi_csv: str, spec: str) -> list[str]:
    """The --gpus each run slot of a host launches with (pure): "auto" once per GPU nvidia-smi lists (the
    wrapper on the host picks a free, unlocked one), each index of an explicit `gpus: 0,1`, or ["none"]
    (no GPU: CPU, one run at a time)."""
    if spec == "none":
        return ["none"]
    if spec != "auto":
        return spec.split(",")
    return ["auto"] * len(gpus.inventory(nvidia_smi_csv)) or ["none"]
