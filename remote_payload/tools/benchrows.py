"""What the bench modules share: a table row and a synthetic prompt (so bench_extract/bench_process need not
import bench, which imports them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from remote_payload.contract.drafterconfig import DrafterConfig


@dataclass
class Row:
    name: str
    rounds: int
    seconds: float
    flops: float
    note: str = ""


def synthetic_prompt(cfg: DrafterConfig, prompt_len: int, completion: int, dev, dtype, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    T = prompt_len + completion
    ids = torch.randint(0, cfg.vocab_size - 1, (T,), generator=g, device=dev)
    feats = torch.randn(T, cfg.fc_in_features, generator=g, device=dev, dtype=dtype)
    return ids, feats
