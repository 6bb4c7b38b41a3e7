"""The CPU decode kernel: paged attention of decode rows as an XLA FFI custom call in C++
(cpu_decode.cc), reading K/V blocks in place from the pool.

On XLA:CPU any jnp formulation copies a step's K/V blocks out of the pool before it computes
(XLA materializes the gather, since each key serves a whole query group), then runs small
batched GEMMs: 7-9 ms per layer for 64 sequences x 256 keys of SmolLM2 where the K/V read
costs ~1-2 ms. The kernel reads each key and value row once, in place, for its whole query
group (as vLLM's CPU paged-attention kernel and the Pallas decode kernel do), with the work
items ((row, KV head) pairs) spread over XLA's intra-op thread pool.

It computes the per-row path of jaxkv/attention/xla_ragged.py (the softmax state of decode
rows: m, l, acc); prefill chunks keep that file's segment path (GEMMs). Pool element types:
float32, bfloat16, float16, and the one-byte types (int8, float8_e4m3fn, float8_e5m2) with
their scales.

Build: the source is compiled once per machine with the system's C++ compiler (g++ or $CXX;
-O3 -march=native, against jaxlib's FFI headers, `jax.ffi.include_dir()`) into
~/.cache/jaxkv/kernels (JAXKV_KERNEL_CACHE=<dir> moves it), keyed by the source, jaxlib's
version, the compiler and the CPU, and loaded with ctypes; about 5 s the first time.
`load()` returns None and `build_error()` says why when no compiler is there or it fails;
the engine then uses the xla backend (jaxkv/engine_config.py resolve_backend).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxkv_paged_decode"
SOURCE = Path(__file__).with_name("cpu_decode.cc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-fPIC", "-shared", "-w")

_error: str | None = None


def cache_dir() -> Path:
    """Where built kernels are kept: $JAXKV_KERNEL_CACHE, or ~/.cache/jaxkv/kernels."""
    where = os.environ.get("JAXKV_KERNEL_CACHE")
    return Path(where) if where else Path.home() / ".cache" / "jaxkv" / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model name and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(cxx: str) -> Path:
    """Compile SOURCE (or reuse a build with the same key); returns the library's path.
    Raises RuntimeError with the compiler's message."""
    import jaxlib
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, version,
                                    " ".join(FLAGS), _cpu_identity()]).encode()).hexdigest()[:16]
    lib = cache_dir() / f"cpu_decode-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)  # renamed in place when done
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cxx).name} failed: {res.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """Build (once per machine) and load the kernel, and register it with XLA for the CPU.
    Returns the library, or None when it cannot be built (see build_error())."""
    global _error
    cxx = _compiler()
    if cxx is None:
        _error = "no C++ compiler found (g++, c++ or $CXX)"
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxkvPagedDecode),
                                    platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        _error = str(e)
        return None
    return lib


def build_error() -> str | None:
    """Why load() returned None (None when it has not failed)."""
    return _error


@functools.cache
def _lut(name: str) -> np.ndarray:
    """float32 [256]: the value of each byte of a one-byte pool type."""
    import ml_dtypes
    dtype = np.int8 if name == "int8" else getattr(ml_dtypes, name)
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def _kind(stored, kv_dtype: str | None) -> tuple[int, str | None]:
    """The kernel's element kind of a pool array (and the one-byte type's name)."""
    name = jnp.dtype(kv_dtype or stored).name
    if name == "float32":
        return 0, None
    if name == "bfloat16":
        return 1, None
    if name == "float16":
        return 2, None
    if name in ("int8", "float8_e4m3fn", "float8_e5m2"):
        return 3, name
    raise ValueError(f"cpu attention: unsupported KV cache dtype {name}")


def paged_decode(q, k_cache, v_cache, tables, ctx, *, layer: int, k_scale=None, v_scale=None,
                 kv_dtype: str | None = None):
    """Softmax state of decode rows over their context, read from the pool in place.

    q: float32 [P, K, G, D], already multiplied by the softmax scale (K KV heads, G query heads
    each); k_cache, v_cache: one pool array each [L, num_blocks, block_size, K, D] as stored
    (jaxkv.attention.kv_pool: float32 / float16, or bfloat16 / float8 bits, or int8) with
    kv_dtype naming the values' type; k_scale, v_scale: their bfloat16 scales (as uint16 bits)
    [L, num_blocks, block_size, K] for a one-byte pool, else None; tables: int32 [P, N] block
    ids (entries past a row's context are never read); ctx: int32 [P] keys of each row (0:
    the row is skipped); layer: which layer of the pool (static).

    Returns float32 (m [P, K, G], l [P, K, G], acc [P, K, G, D]): max score, sum of
    exp(score - m), and the exp-weighted values, as xla_ragged's per-row path; (-inf, 0, 0)
    for rows with ctx 0. Raises RuntimeError if the kernel is not built (load() is None).
    """
    if load() is None:
        raise RuntimeError(f"cpu attention kernel unavailable: {build_error()}")
    kind, name = _kind(k_cache.dtype, kv_dtype)
    if kind == 3:
        lut = jnp.asarray(_lut(name))
        ks, vs = (jax.lax.bitcast_convert_type(s, jnp.uint16) if s.dtype != jnp.uint16 else s
                  for s in (k_scale, v_scale))
    else:
        lut = jnp.zeros((1,), jnp.float32)
        ks = vs = jnp.zeros((1,), jnp.uint16)
    p, nk, g, d = q.shape
    out = (jax.ShapeDtypeStruct((p, nk, g), jnp.float32),
           jax.ShapeDtypeStruct((p, nk, g), jnp.float32),
           jax.ShapeDtypeStruct((p, nk, g, d), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out)
    return call(q.astype(jnp.float32), k_cache, v_cache, ks, vs, lut,
                tables.astype(jnp.int32), ctx.astype(jnp.int32),
                layer=np.int64(layer), kind=np.int64(kind))


def row_kernel(q, pool, layer, tables, ctx):
    """paged_decode behind xla_ragged_paged_attention's row_kernel hook: pool is its tuple
    (k_cache, v_cache, k_scale, v_scale, kv_dtype)."""
    k_cache, v_cache, k_scale, v_scale, kv_dtype = pool
    return paged_decode(q, k_cache, v_cache, tables, ctx, layer=layer, k_scale=k_scale,
                        v_scale=v_scale, kv_dtype=kv_dtype)
