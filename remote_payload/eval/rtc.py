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
import hashlib
import os
import secrets
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from remote_payload.contract.runstate import open_regular

CHUNK = 32  # columns per maximum (kernels.LSE_CHUNK)
THREADS = 512  # per block: one block a row; 8 bf16 (16 bytes) a load
_MAGIC = b"reval-cubin-1\n"

SOURCE = r"""
#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)

__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2) {
    float mn = fmaxf(m, m2);
    if (mn == NEG_INF) { s = s + s2; return; }          // nothing seen yet (0 + 0, or a NaN carried)
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

__device__ __forceinline__ void lo_hi(unsigned int w, float &a, float &b) {
    a = __uint_as_float(w << 16);            // the lower bf16 of the word is the earlier column
    b = __uint_as_float(w & 0xffff0000u);
}

// One block per row of x (bf16 as uint16, rows row_stride elements apart, n_vec * 8 columns, 16-byte aligned).
// lse[row] = logsumexp of the row in fp32; when want_max, cmax[row * n_chunks + c] = max of columns 32c..32c+31.
extern "C" __global__ void __launch_bounds__(512) lse_cmax_bf16(
        const uint4 *__restrict__ x, float *__restrict__ lse, unsigned short *__restrict__ cmax,
        long long row_stride_vec, int n_vec, int n_chunks, int want_max) {
    const long long row = blockIdx.x;
    const uint4 *p = x + row * row_stride_vec;
    const int lane = threadIdx.x & 31;
    float m = NEG_INF, s = 0.f;
    for (int base = 0; base < n_vec; base += blockDim.x) {      // every thread runs every round (shuffles)
        const int i = base + threadIdx.x;
        const bool in = i < n_vec;
        float v[8];
        if (in) {
            const uint4 q = p[i];
            lo_hi(q.x, v[0], v[1]); lo_hi(q.y, v[2], v[3]); lo_hi(q.z, v[4], v[5]); lo_hi(q.w, v[6], v[7]);
        } else {
            #pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = NEG_INF;
        }
        float lm = v[0];
        #pragma unroll
        for (int j = 1; j < 8; ++j) lm = fmaxf(lm, v[j]);
        if (want_max) {                      // 4 neighbouring lanes hold one chunk of 32 columns
            float cm = fmaxf(lm, __shfl_xor_sync(0xffffffffu, lm, 1));
            cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
            if (in && (lane & 3) == 0)
                cmax[row * n_chunks + (i >> 2)] = (unsigned short)(__float_as_uint(cm) >> 16);
        }
        if (!in) continue;
        const float mn = fmaxf(m, lm);
        if (mn == NEG_INF) continue;        // all -inf so far
        float acc = 0.f;
        #pragma unroll
        for (int j = 0; j < 8; ++j) acc += expf(v[j] - mn);   // a NaN value makes acc NaN: carried to lse
        s = s * expf(m - mn) + acc;
        m = mn;
        if (lm != lm) s = QNAN;              // all 8 NaN (fmaxf dropped them)
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
    }
    __shared__ float wm[32], ws[32];
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) { wm[warp] = m; ws[warp] = s; }
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? wm[lane] : NEG_INF;
        s = lane < nwarps ? ws[lane] : 0.f;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            merge(m, s, m2, s2);
        }
        if (lane == 0) lse[row] = m + logf(s);   // all -inf: -inf + log(0) = -inf
    }
}
// fp32 -> the nearest bf16 value (ties to even), kept in fp32; NaN stays NaN
__device__ __forceinline__ float rb(float v) {
    unsigned int b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return v;
    return __uint_as_float((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
}
__device__ __forceinline__ unsigned short bits16(float v) {     // v a bf16 value (rb's output)
    unsigned int b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((b >> 16) & 0x8000u) | 0x7fc0u);
    return (unsigned short)(b >> 16);
}
__device__ __forceinline__ float f32(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }

// apply_rope on one row of x [rows, nh, 2*half] with cos/sin [rows, 2*half], torch's four bf16 roundings:
// lo = (x1*c1) + (-x2*s1), hi = (x2*c2) + (x1*s2), each product and the sum rounded to bf16
extern "C" __global__ void rope_bf16(const unsigned short *__restrict__ x, const unsigned short *__restrict__ cs,
                                     const unsigned short *__restrict__ sn, unsigned short *__restrict__ out,
                                     int nh, int half) {
    const long long row = blockIdx.x;
    const unsigned short *xr = x + row * nh * 2 * half;
    unsigned short *orow = out + row * nh * 2 * half;
    const unsigned short *c = cs + row * 2 * half, *s = sn + row * 2 * half;
    for (int idx = threadIdx.x; idx < nh * half; idx += blockDim.x) {
        const int h = idx / half, j = idx - h * half;
        const float x1 = f32(xr[h * 2 * half + j]), x2 = f32(xr[h * 2 * half + half + j]);
        const float lo = rb(rb(x1 * f32(c[j])) + rb(-x2 * f32(s[j])));
        const float hi = rb(rb(x2 * f32(c[half + j])) + rb(x1 * f32(s[half + j])));
        orow[h * 2 * half + j] = bits16(lo);
        orow[h * 2 * half + half + j] = bits16(hi);
    }
}

// silu(gate) * up over [rows, n] (rows of gate and up strided, out contiguous): torch's two bf16 roundings,
// its exp (expf, not the fast one) and IEEE division
extern "C" __global__ void silu_mul_bf16(const unsigned short *__restrict__ g, const unsigned short *__restrict__ u,
                                         unsigned short *__restrict__ out, int n, long long g_stride,
                                         long long u_stride) {
    const long long row = blockIdx.x;
    for (int k = 0; k < 4; ++k) {
        const int i = blockIdx.y * 1024 + k * 256 + threadIdx.x;
        if (i >= n) return;
        const float gv = f32(g[row * g_stride + i]), uv = f32(u[row * u_stride + i]);
        const float act = rb(__fdiv_rn(gv, 1.0f + expf(-gv)));
        out[row * n + i] = bits16(rb(act * uv));
    }
}
"""
KERNELS = ("lse_cmax_bf16", "rope_bf16", "silu_mul_bf16")

_lock = threading.Lock()
_state: dict = {}  # device index -> ({kernel name: function handle}, None) or (None, reason)
_pending: dict = {}  # arch -> Future of (cubin, from the cache, seconds): precompile's thread
_how: dict = {}  # device index -> how its kernels came
_libs: dict = {}


def enabled() -> bool:
    return os.environ.get("REVAL_RTC", "1") != "0" and not os.environ.get("REVAL_TORCH_KERNELS")


def cache_dir() -> Path:
    if os.environ.get("REVAL_KERNEL_CACHE"):
        return Path(os.environ["REVAL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reval" / "kernels"


def _lib(name: str, candidates: list[str]) -> ctypes.CDLL:
    if name not in _libs:
        err = None
        for c in candidates:
            try:
                _libs[name] = ctypes.CDLL(c)
                break
            except OSError as e:
                err = e
        else:
            raise OSError(f"{name}: none of {candidates} could be loaded ({err})")
    return _libs[name]


def _cuda() -> ctypes.CDLL:
    return _lib("libcuda", ["libcuda.so.1", "libcuda.so"])


def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "0").split(".")[0]
    return _lib("libnvrtc", [f"libnvrtc.so.{major}", "libnvrtc.so"])


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode(errors='replace')})")


def _nvrtc_version() -> str:
    a, b = ctypes.c_int(), ctypes.c_int()
    if _nvrtc().nvrtcVersion(ctypes.byref(a), ctypes.byref(b)) != 0:
        raise RuntimeError("nvrtcVersion failed")
    return f"{a.value}.{b.value}"


def compile_cubin(arch: str) -> bytes:
    """SOURCE through NVRTC for `arch` (e.g. "sm_90") -> the cubin; the compiler's log in the error."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"reval_kernels.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the lse kernel for {arch}: "
                               f"{' '.join(log.value.decode(errors='replace').split())[:300]}")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or not size.value:
            raise RuntimeError(f"NVRTC gave no cubin for {arch}")
        buf = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, buf) != 0:
            raise RuntimeError("nvrtcGetCUBIN failed")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def cubin_path(arch: str, nvrtc_version: str) -> Path:
    key = hashlib.sha256(f"{SOURCE}\0{arch}\0{nvrtc_version}".encode()).hexdigest()[:20]
    return cache_dir() / f"reval-kernels-{arch}-{key}.cubin"


MAX_CUBIN_BYTES = 16 << 20  # the three kernels' cubin is tens of KB; a bigger file is not ours to read whole


def read_cached(path: Path) -> bytes | None:
    """The cubin kept at `path`, or None when there is none, it is not a regular file (a FIFO would block the
    read, a link to /dev/zero never end it), it is not whole (its sha256 disagrees) or it is larger than any
    cubin of these kernels."""
    try:
        with open_regular(path, nofollow=True) as f:
            if os.fstat(f.fileno()).st_size > MAX_CUBIN_BYTES:
                return None
            blob = f.read(MAX_CUBIN_BYTES + 1)
    except OSError:
        return None
    head = len(_MAGIC) + 32
    if not blob.startswith(_MAGIC) or len(blob) <= head:
        return None
    body = blob[head:]
    return body if hashlib.sha256(body).digest() == blob[len(_MAGIC):head] else None


def write_cached(path: Path, cubin: bytes) -> None:
    """Written whole or not at all (a temp file renamed into place); a cache that cannot be written is skipped.
    Writers at once (threads, processes, the nodes of a cluster sharing the venv's cache) each write their own
    temp file (a random name: pids repeat across nodes) and rename it over the same name: a reader finds the
    old file, a whole new one or none, never a mix (the content is the same either way)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(_MAGIC + hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()  # a disk full mid-write, a refused rename: no half file left behind
        except OSError:
            pass


def cubin_for(arch: str, nvrtc_version: str, compile_fn=compile_cubin) -> tuple[bytes, bool]:
    """(the kernel's cubin for `arch`, whether it came from the cache): compiled and kept when the cache lacks
    it or holds a damaged copy."""
    path = cubin_path(arch, nvrtc_version)
    got = read_cached(path)
    if got is not None:
        return got, True
    cubin = compile_fn(arch)
    write_cached(path, cubin)
    return cubin, False


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
        arch = _arch(_index(device))
    except Exception:  # noqa: BLE001 - `available` meets the same failure and says it
        return
    with _lock:
        if arch in _pending:
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
    cubin, cached, secs = fut.result() if fut is not None else _cubin_timed(arch)
    _how[index] = "from the kernel cache" if cached else f"compiled by NVRTC in {secs:.2f}s"
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
