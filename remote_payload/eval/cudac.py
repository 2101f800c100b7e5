"""The eval's CUDA C passes as source, compiled by NVRTC into a cubin kept in the kernel cache: the torch-free
half of rtc.py (ctypes and the standard library only), so that a process can read or compile the cubin before
torch is imported (early.py: beside `import torch`, on a fresh host) and rtc.py load it later.

The cubin is kept under REVAL_KERNEL_CACHE (the venv's, runtime/kcache.py; else ~/.cache/reval/kernels), named by
the sha256 of the source, the GPU architecture and NVRTC's version, stored with its own sha256 and checked when
read back (`read_cached`), written whole or not at all (`write_cached`).
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import secrets
import sys
from pathlib import Path

from remote_payload.contract.runstate import open_regular

_MAGIC = b"reval-cubin-1\n"
_libs: dict = {}

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


def nvrtc_candidates(major: str) -> list[str]:
    """Where NVRTC of CUDA `major` may be: its soname (a library torch or the system already provides), then
    the copies the NVIDIA wheels install next to torch (site-packages/nvidia/.../lib), found without importing
    torch."""
    out = [f"libnvrtc.so.{major}"]
    for base in sys.path:
        out += sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    return out + ["libnvrtc.so"]


def torch_cuda_major() -> str | None:
    """The CUDA major version torch was built with, read from torch/version.py's text (importing torch.version
    would import torch); None when it cannot be read."""
    for base in sys.path:
        f = Path(base or ".") / "torch" / "version.py"
        try:
            m = re.search(r"^cuda\b[^=]*=\s*['\"](\d+)\.", f.read_text(), re.MULTILINE)
        except OSError:
            continue
        return m.group(1) if m else None
    return None


def nvrtc(major: str) -> ctypes.CDLL:
    return _lib("libnvrtc", nvrtc_candidates(major))


def nvrtc_version(lib: ctypes.CDLL) -> str:
    a, b = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b)) != 0:
        raise RuntimeError("nvrtcVersion failed")
    return f"{a.value}.{b.value}"


def compile_cubin(arch: str, lib: ctypes.CDLL) -> bytes:
    """SOURCE through NVRTC for `arch` (e.g. "sm_90") -> the cubin; the compiler's log in the error."""
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


def cubin_for(arch: str, nvrtc_version: str, compile_fn) -> tuple[bytes, bool]:
    """(the kernel's cubin for `arch`, whether it came from the cache): compiled and kept when the cache lacks
    it or holds a damaged copy."""
    path = cubin_path(arch, nvrtc_version)
    got = read_cached(path)
    if got is not None:
        return got, True
    cubin = compile_fn(arch)
    write_cached(path, cubin)
    return cubin, False
