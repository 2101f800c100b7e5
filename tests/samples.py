"""Generated inputs shared by test modules (tests/gpu among them) and benchmarks: log-probability rows and target
ranks for the DDTree checks, the logits that break naive top-k code, the tensors of the safetensors tests (the
`st_file` fixture in conftest.py), and a tiny hand-built wheel for the offline venv."""
from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import numpy as np


def sorted_logprobs(rng, shape, ties=False):
    """[..., K] rows of log-probabilities sorted descending; with ties, drawn from a few exact values."""
    if ties:
        x = rng.choice([-0.5, -1.0, -2.0, -4.0], size=shape)
    else:
        logits = rng.normal(size=shape) * 2
        x = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.sort(-x, axis=-1)


def random_targets(rng, n, depth, k):
    """Mostly small ranks (so paths go deep), some >= K, some rows ending the sequence (-1)."""
    r = rng.geometric(0.45, size=(n, depth)) - 1
    r[rng.random((n, depth)) < 0.03] = k + 3
    for j in range(0, n, 7):
        r[j, rng.integers(1, depth):] = -1
    return r


def sample_tensors() -> dict:
    """One tensor of each dtype safetensors stores, scalars and empty ones among them (seeded)."""
    import torch
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, 11, generator=g).bfloat16(),
        "f16": torch.randn(4, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.randint(-2**40, 2**40, (2, 3, 2), generator=g),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 3), generator=g, dtype=torch.uint8),
        "bool": torch.rand(6, generator=g) > 0.5,
        "scalar_f32": torch.tensor(3.25),
        "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty_f16": torch.empty(0, 3, dtype=torch.float16),
        "empty_i64": torch.empty(0, dtype=torch.int64),
    }


def tricky_logits(n: int, v: int, dtype, seed: int):
    """[n, v] logits whose first rows break naive top-k code: ties, signed zeros, -inf, winners at the end, all
    distinct ascending; the rest random."""
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 3
    x[0] = torch.randint(0, 4, (v,), generator=g).float()  # 4 distinct values: ties everywhere
    x[1] = 0.0
    x[1, ::3] = -0.0  # signed zeros are one value
    x[2, : v // 2] = float("-inf")
    x[3, -70:] = 50.0  # every winner in the last chunks
    x[4] = torch.linspace(-1, 1, v)  # all distinct, ascending: the winners are the highest ids
    return x.to(dtype)


def make_wheel(wheelhouse: Path, name: str = "revaltiny", version: str = "1.0") -> Path:
    """A minimal pure-python wheel built by hand (no network, no build backend)."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: reval-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for rel, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{rel},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    path = wheelhouse / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path
