"""--device / --dtype for every payload command: auto = CUDA in bf16 when present, else CPU in fp32."""
from __future__ import annotations

import torch

from remote_payload.contract.errors import PayloadError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PayloadError(f"--device {device}: CUDA is not available on this host; use --device cpu")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]
