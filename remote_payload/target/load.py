"""The target model from its HF folder, local files only: `check_target` before anything big is read (config.json,
weights, tokenizer.json, the tapped layers in range), `load_target` (on one device, or spread over several GPUs),
`eos_ids_of`, `weights_bytes`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from remote_payload.contract.errors import PayloadError
from remote_payload.contract.runstate import read_regular

if TYPE_CHECKING:  # torch is imported where a target is loaded: the checks run where torch is missing
    import torch

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def num_layers_of(config: dict) -> int:
    """Decoder layer count from a config.json dict (plain or multimodal with text_config)."""
    n = config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers")
    if not n:
        raise PayloadError("target config.json has no num_hidden_layers (nor text_config.num_hidden_layers)")
    return int(n)


def eos_ids_of(target: Path) -> set[int]:
    ids: set[int] = set()
    for f in ("generation_config.json", "config.json"):
        if (target / f).is_file():
            e = json.loads(read_regular(target / f)).get("eos_token_id")
            ids |= set(e) if isinstance(e, list) else ({e} if e is not None else set())
    return ids


def check_target(target: str | os.PathLike, layer_ids: list[int]) -> dict:
    """Validate a target dir before loading anything big; returns its config.json dict."""
    target = Path(target)
    if not (target / "config.json").is_file():
        raise PayloadError(f"--target {target}: no config.json; point --target at a HF model directory")
    if not any((target / f).is_file() for f in _WEIGHT_FILES):
        raise PayloadError(f"--target {target}: no weights ({' / '.join(_WEIGHT_FILES)}); copy the full model")
    if not (target / "tokenizer.json").is_file():
        raise PayloadError(f"--target {target}: no tokenizer.json; copy the model's tokenizer files too")
    config = json.loads(read_regular(target / "config.json"))
    n = num_layers_of(config)
    bad = [l for l in layer_ids if l >= n]
    if bad:
        raise PayloadError(f"--layers {','.join(map(str, layer_ids))}: layer ids {bad} >= the target's {n} layers; "
                           f"use ids in 0..{n - 1}")
    return config


def load_target(target: str | os.PathLike, device: torch.device, dtype: torch.dtype, *,
                shard_over: list[int] | None = None):
    """HF causal LM from local files only, eval mode, on device. On a GPU with `accelerate` installed the
    weights are read straight onto the device (device_map), with no full copy in host memory first.
    shard_over: CUDA device indices to spread the layers over (accelerate's device_map="auto" limited to those
    GPUs), for a target too big for one; `device` is then the first of them."""
    import importlib.util

    import torch
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    # `torch_dtype` was renamed `dtype` in 4.56; pass whichever this version knows.
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    if shard_over:
        if importlib.util.find_spec("accelerate") is None:
            raise PayloadError("--shard: loading a target across GPUs needs the `accelerate` package; pip install "
                               "accelerate, or use one GPU a process (--gpus without --shard)")
        kw["device_map"] = "auto"
        kw["max_memory"] = {i: int(torch.cuda.get_device_properties(i).total_memory * 0.85) for i in shard_over}
        return transformers.AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, **kw).eval()
    if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kw["device_map"] = {"": str(device)}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, **kw)
    return model.to(device).eval()


def weights_bytes(target: str | os.PathLike) -> int:
    """Bytes of the target's weight files (what loading it takes on a device, about)."""
    target = Path(target)
    files = {f for f in target.glob("*.safetensors")} or {f for f in target.glob("pytorch_model*.bin")}
    return sum(f.stat().st_size for f in files)
