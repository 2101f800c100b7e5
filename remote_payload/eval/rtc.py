"""The eval's fused passes as CUDA C, compiled by NVRTC and launched through the CUDA driver (ctypes).

Why not Triton here: at the seeds' size (10 prompts x 30 blocks, 1.8e10 logits) Triton's start in a fresh
process (its import, the hash of its own 500 MB library for its cache key, its launcher) cost more than its
pass saved (kernels.py, TRITON_PAYS_ELEMENTS), so the seeds' run reduced its logits with torch's log-softmax
(an fp32 copy of the logits, then an fp32 output; docs/benchmarks.md) and a separate max pass for the top-k.
NVRTC and the driver are what CUDA torch already loads: no import, nothing hashed; the
kernel is compiled once per host (NVRTC, a fraction of a second, on the prime's thread beside the weight load)
and kept as a cubin under the kernel cache (REVAL_KERNEL_CACHE: the venv's, runtime/kcache.py; else
~/.cache/reval/kernels), checked by its sha256 when read back; a later process reads and loads it in
milliseconds.

`lse_cmax(logits [N, V] bf16)` -> (logsumexp [N, 1] fp32, each 32 columns' maximum [N, V/32] bf16): one read
of the logits, an online max/sum per thread in fp32 (expf, not the fast approximation), the same contract as
the Triton pass it stands beside (triton_kernels.lse_kernel): equal to `logsumexp(logits.float())` within fp32
rounding, the chunk maxima exact (each is one of the values). `available(device)` says whether it runs here
(CUDA, NVRTC and the driver found, the kernel compiled and loaded), else why not; REVAL_RTC=0 turns it off.
Anything that fails leaves the caller on the torch / Triton paths (kernels.lse_topk).
`rope` and `silu_mul`: drafter.apply_rope and silu(gate) * up in one pass each, torch's bf16 numbers bit for bit
(the roundings of the Triton passes in triton_kernels.py, which extract's decode steps keep using).
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import Future

import torch

from remote_payload.eval import cudac, early
from remote_payload.eval.cudac import (  # noqa: F401 - the cubin's cache, named here too (tests, kcache's doc)
    KERNELS,
    SOURCE,
    _lib,
    cache_dir,
    cubin_path,
    read_cached,
    write_cached,
)

CHUNK = 32  # columns per maximum (kernels.LSE_CHUNK)
THREADS = 512  # per block: one block a row; 8 bf16 (16 bytes) a load


_lock = threading.Lock()
_state: dict = {}  # device index -> ({kernel name: function handle}, None) or (None, reason)
_pending: dict = {}  # arch -> Future of (cubin, from the cache, seconds): precompile's thread
_how: dict = {}  # device index -> how its kernels came
_early: set = set()  # the archs whose cubin early.py's thread read or compiled


def enabled() -> bool:
    return os.environ.get("REVAL_RTC", "1") != "0" and not os.environ.get("REVAL_TORCH_KERNELS")


def _cuda() -> ctypes.CDLL:
    return _lib("libcuda", ["libcuda.so.1", "libcuda.so"])


def _nvrtc() -> ctypes.CDLL:
    return cudac.nvrtc((torch.version.cuda or "0").split(".")[0])


def _nvrtc_version() -> str:
    return cudac.nvrtc_version(_nvrtc())


def compile_cubin(arch: str) -> bytes:
    return cudac.compile_cubin(arch, _nvrtc())


def cubin_for(arch: str, nvrtc_version: str, compile_fn=compile_cubin) -> tuple[bytes, bool]:
    return cudac.cubin_for(arch, nvrtc_version, compile_fn)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode(errors='replace')})")


def _ensure_context(index: int) -> None:
    cur = ctypes.c_void_p()
    _check(_cuda().cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if not cur.value:  # a thread torch has not used yet: torch's context is the device's primary one
        ctx = ctypes.c_void_p()
        _check(_cuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), index), "cuDevicePrimaryCtxRetain")
        _check(_cuda().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _index(device: torch.device) -> int:
    """The CUDA device's index (torch's current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def _cubin_timed(arch: str) -> tuple[bytes, bool, float]:
    t = time.perf_counter()
    cubin, cached = cubin_for(arch, _nvrtc_version())
    return cubin, cached, time.perf_counter() - t


def precompile(device: torch.device) -> None:
    """Read or compile the cubin for `device`'s GPU on a thread of its own (NVRTC's compile holds no GIL), so
    that the load (`available`, on the prime's thread) finds it ready. Nothing where it would not run."""
    if device.type != "cuda" or not enabled() or torch.version.hip:
        return
    try:
        index = _index(device)
        arch = _arch(index)
    except Exception:  # noqa: BLE001 - `available` meets the same failure and says it
        return
    with _lock:
        if arch in _pending:
            return
        ahead = early.cubin(index, arch)  # read or compiled beside `import torch` (early.py)
        if ahead is not None:
            _pending[arch] = ahead
            _early.add(arch)
            return
        fut: Future = Future()
        _pending[arch] = fut

    def run():
        try:
            fut.set_result(_cubin_timed(arch))
        except BaseException as e:  # noqa: BLE001 - handed to `available` through the future
            fut.set_exception(e)
    threading.Thread(target=run, name="reval-nvrtc", daemon=True).start()


def _load(device: torch.device, index: int):
    arch = _arch(index)
    fut = _pending.get(arch)
    got = fut.result() if fut is not None else None
    cubin, cached, secs = got if got is not None else _cubin_timed(arch)  # None: the early thread found none
    where = " beside the imports" if got is not None and arch in _early else ""
    _how[index] = ("from the kernel cache" if cached else f"compiled by NVRTC in {secs:.2f}s") + where
    with torch.cuda.device(index):
        torch.cuda.current_stream(index)  # torch's context made current on this thread
        _ensure_context(index)
        version = _nvrtc_version()
        mod = ctypes.c_void_p()
        rc = _cuda().cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin))
        if rc != 0:  # a cubin this driver cannot load: compile it again, once
            cubin = compile_cubin(arch)
            write_cached(cubin_path(arch, version), cubin)
            _check(_cuda().cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)), "cuModuleLoadData")
        fns = {}
        for name in KERNELS:
            fn = ctypes.c_void_p()
            _check(_cuda().cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction {name}")
            fns[name] = fn
    return fns


def available(device: torch.device) -> str | None:
    """None when `lse_cmax` runs on `device` (loading the kernel the first time: compiled, or read from the
    cache); else why not, in a few words."""
    if device.type != "cuda":
        return "not a CUDA device"
    if not enabled():
        return "turned off (REVAL_RTC=0 or REVAL_TORCH_KERNELS)"
    if torch.version.hip:
        return "a ROCm build"
    index = _index(device)
    with _lock:
        if index not in _state:
            try:
                _state[index] = (_load(torch.device("cuda", index), index), None)
            except Exception as e:  # noqa: BLE001 - any failure: the torch / Triton paths run instead
                _state[index] = (None, " ".join(f"{type(e).__name__}: {e}".split())[:300])
        return _state[index][1]


def how(device: torch.device) -> str:
    """A few words for the log: how the CUDA C kernels came (compiled now, or from the cache), or why they do
    not run."""
    why = available(device)
    if why is not None:
        return f"not used: {why}"
    return _how.get(_index(device), "loaded")


def applies(logits: torch.Tensor) -> bool:
    """The layout `lse_cmax` takes: CUDA bf16 [N, V], unit column stride, V a multiple of CHUNK, rows and the
    start 16-byte aligned."""
    return (logits.is_cuda and logits.dtype == torch.bfloat16 and logits.dim() == 2 and logits.shape[0] > 0
            and logits.stride(1) == 1 and logits.shape[1] % CHUNK == 0 and logits.stride(0) % 8 == 0
            and logits.data_ptr() % 16 == 0 and logits.shape[0] < 2 ** 31)


def lse_cmax(logits: torch.Tensor, want_max: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logsumexp [N, 1] fp32, the maximum of every CHUNK columns [N, V/CHUNK] bf16 or None) in one pass.
    Call only where `applies(logits)` and `available(logits.device) is None`."""
    n, v = logits.shape
    fn = _fns(logits.device)["lse_cmax_bf16"]
    lse = torch.empty(n, device=logits.device, dtype=torch.float32)
    cmax = torch.empty(n, v // CHUNK, device=logits.device, dtype=torch.bfloat16) if want_max else None
    _launch(fn, (n, 1), THREADS, logits.device, [
        ctypes.c_void_p(logits.data_ptr()), ctypes.c_void_p(lse.data_ptr()),
        ctypes.c_void_p(cmax.data_ptr() if cmax is not None else 0), ctypes.c_longlong(logits.stride(0) // 8),
        ctypes.c_int(v // 8), ctypes.c_int(v // CHUNK), ctypes.c_int(int(want_max))])
    return lse[:, None], cmax


def _launch(fn, grid: tuple[int, int], threads: int, device: torch.device, args: list) -> None:
    index = _index(device)
    if torch.cuda.current_device() != index:  # the function belongs to that device's context: make it current
        with torch.cuda.device(index):
            return _launch(fn, grid, threads, device, args)
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    stream = torch.cuda.current_stream(device).cuda_stream
    _check(_cuda().cuLaunchKernel(fn, grid[0], grid[1], 1, threads, 1, 1, 0, ctypes.c_void_p(stream), params, None),
           "cuLaunchKernel")
    return None


def _fns(device: torch.device) -> dict:
    return _state[_index(device)][0]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """drafter.apply_rope, bit for bit: x [..., NH, d] contiguous bf16, cos/sin [..., 1, d] contiguous bf16 with
    x's leading shape, d even. Call only where `available(x.device) is None` (kernels.rope checks the rest)."""
    nh, d = x.shape[-2:]
    out = torch.empty_like(x)
    rows = x.numel() // (nh * d)
    if rows:
        _launch(_fns(x.device)["rope_bf16"], (rows, 1), 256, x.device, [
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(cos.data_ptr()), ctypes.c_void_p(sin.data_ptr()),
            ctypes.c_void_p(out.data_ptr()), ctypes.c_int(nh), ctypes.c_int(d // 2)])
    return out


def silu_mul(g2: torch.Tensor, u2: torch.Tensor, shape) -> torch.Tensor:
    """silu(gate) * up, bit for bit as torch: g2, u2 [rows, n] bf16 with unit column stride (rows strided);
    the result contiguous, of `shape`. Call only where `available(g2.device) is None`."""
    rows, n = g2.shape
    out = torch.empty(shape, dtype=g2.dtype, device=g2.device)
    if rows and n:
        _launch(_fns(g2.device)["silu_mul_bf16"], (rows, -(-n // 1024)), 256, g2.device, [
            ctypes.c_void_p(g2.data_ptr()), ctypes.c_void_p(u2.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int(n), ctypes.c_longlong(g2.stride(0)), ctypes.c_longlong(u2.stride(0))])
    return out
