"""The GPU's start, beside `import torch` (ctypes and the standard library only): `python -m remote_payload eval`
calls `start(argv)` before it imports torch and the eval (3 s on an H200 host, most of it torch's import), and
a thread of its own meanwhile

  1. initialises the CUDA driver and makes the eval's device's primary context (the context torch then finds
     and uses: it is the device's primary one), a few tenths of a second a process pays otherwise at its first
     CUDA call;
  2. reads the eval's CUDA C cubin from the kernel cache, or on a fresh host compiles it with NVRTC (cudac.py:
     the library found beside torch without importing it), which rtc.py otherwise does beside the weight load,
     where it competes with the load and the warm-up.

Both calls hold no GIL (ctypes releases it), so the import does not wait for them. The device is the eval's
`--device` (auto and cuda: the first visible GPU; cuda:N: that one); nothing starts for --device cpu, for
--gpus (each worker its own device), for --help, or with REVAL_EARLY=0 (the bench's variant measuring it). Any
failure (no driver, no GPU, no NVRTC) ends the thread quietly: rtc.py and torch then do their own start as
before, and say what fails. `cubin(index)` hands rtc.py the cubin's Future for that device, or None.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import Future

from remote_payload.eval import cudac

ATTR_CC_MAJOR, ATTR_CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
_job: dict = {}  # "index" -> the device ordinal; "cubin" -> Future of (cubin, from the cache, seconds) or None
_times: dict = {}  # "context" -> seconds the driver's init and the primary context took on the thread


def device_index(argv: list[str]) -> int | None:
    """The CUDA ordinal the eval in `argv` will use, or None where nothing should start early."""
    if os.environ.get("REVAL_EARLY", "1") == "0" or any(a in ("-h", "--help") or a.startswith("--gpus")
                                                        for a in argv):
        return None
    value = "auto"
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--device="):
            value = a.split("=", 1)[1]
    value = value.strip().lower()
    if value in ("auto", "cuda"):
        return 0
    if value.startswith("cuda:") and value[5:].isdigit():
        return int(value[5:])
    return None


def start(argv: list[str]) -> bool:
    """Start the thread for the eval in `argv` (see the module's doc); whether it started."""
    index = device_index(argv)
    if index is None or _job:
        return False
    fut: Future = Future()
    _job.update(index=index, cubin=fut)
    threading.Thread(target=_run, args=(index, fut), name="reval-early", daemon=True).start()
    return True


def _rtc_enabled() -> bool:
    return os.environ.get("REVAL_RTC", "1") != "0" and not os.environ.get("REVAL_TORCH_KERNELS")


def _run(index: int, fut: Future) -> None:
    try:
        fut.set_result(_start_device(index))
    except BaseException:  # noqa: BLE001 - nothing early is needed: rtc.py and torch start as before and say why
        fut.set_result(None)


def _start_device(index: int):
    t = time.perf_counter()
    cuda = cudac._lib("libcuda", ["libcuda.so.1", "libcuda.so"])
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return None
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:  # kept: it is torch's context from here on
        return None
    _times["context"] = time.perf_counter() - t
    major, minor = ctypes.c_int(), ctypes.c_int()
    if (cuda.cuDeviceGetAttribute(ctypes.byref(major), ATTR_CC_MAJOR, dev) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), ATTR_CC_MINOR, dev) != 0):
        return None
    cuda_major = cudac.torch_cuda_major()
    if not _rtc_enabled() or cuda_major is None:
        return None
    t = time.perf_counter()
    lib = cudac.nvrtc(cuda_major)
    arch = f"sm_{major.value}{minor.value}"
    cubin, cached = cudac.cubin_for(arch, cudac.nvrtc_version(lib), lambda a: cudac.compile_cubin(a, lib))
    return arch, cubin, cached, time.perf_counter() - t


def cubin(index: int, arch: str) -> Future | None:
    """The early thread's Future of (cubin, from the cache, seconds) for device `index` of `arch`, resolving to
    None where it found nothing; None when no thread ran for that device."""
    fut = _job.get("cubin") if _job.get("index") == index else None
    if fut is None:
        return None
    out: Future = Future()

    def done(f: Future) -> None:
        got = f.result()
        out.set_result(got[1:] if got is not None and got[0] == arch else None)
    fut.add_done_callback(done)
    return out


def context_seconds() -> float | None:
    """How long the driver's init and the primary context took on the early thread (None: not made there)."""
    return _times.get("context")
