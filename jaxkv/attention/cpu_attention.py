"""The CPU attention kernel: ragged paged attention as an XLA FFI custom call in C++
(cpu_attention.cc) that reads K/V blocks in place from the pool.

On XLA:CPU any jnp formulation copies a step's K/V blocks out of the pool before it computes
(XLA materializes the gather, since each key serves a whole query group), then runs small
batched GEMMs: 7-9 ms per layer for 64 decoding sequences x 256 keys of SmolLM2 where reading
their K/V costs ~1-2 ms, and 16 ms per layer for six 16-token prompt tails over 1,536 cached
keys. The kernel tiles as FlashAttention-2 does for variable-length batches (Dao 2023): a work
item is one KV head of up to 32 / group query rows of one sequence, its keys go by tiles of
16 (transposed into a buffer, so the score GEMM has keys in the SIMD lanes), with an online
softmax; every K/V row is read once per item for all its rows and query heads, and items are
spread over XLA's intra-op thread pool. Semantics are pallas_kernels.reference's (vLLM's
ragged paged attention), against which it is tested. Pool element types: float32, bfloat16,
float16, and the one-byte types (int8, float8_e4m3fn, float8_e5m2) with their scales; q and
the output in float32, bfloat16 or float16.

Build: the source is compiled once per machine with the system's C++ compiler (g++ or $CXX;
-O3 -march=native, against jaxlib's FFI headers, `jax.ffi.include_dir()`) into
~/.cache/jaxkv/kernels (JAXKV_KERNEL_CACHE=<dir> moves it), keyed by the source, jaxlib's
version, the compiler and the CPU, and loaded with ctypes: about 8 s the first time.
`load()` returns None and `build_error()` says why when no compiler is there, it fails, or
the cache folder cannot be written; an engine asked for "auto" then uses the xla backend
(jaxkv/engine/setup.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxkv_ragged_paged_attention"
SOURCE = Path(__file__).with_name("cpu_attention.cc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-fPIC", "-shared", "-w")

_error: str | None = None
build_info: dict = {}  # after load(): {"seconds": build or load time, "cached": bool, "path"}


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


def _compiler() -> list[str] | None:
    """The C++ compiler's command: $CXX (split as a shell would: "ccache g++"), or g++, or
    c++ on PATH; None when there is none."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = shutil.which("g++") or shutil.which("c++")
    return [found] if found else None


def _build(cxx: list[str]) -> Path:
    """Compile SOURCE (or reuse a build with the same key); returns the library's path.
    Raises RuntimeError with the compiler's message."""
    import jaxlib
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise RuntimeError(f"cannot run {' '.join(cxx)}: {e}") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), jaxlib.__version__, version,
                                    " ".join(FLAGS), _cpu_identity()]).encode()).hexdigest()[:16]
    name = f"cpu_attention-{key}.so"
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / "jaxkv-kernels"):
        lib = folder / name
        build_info.update(cached=lib.exists(), path=str(lib))
        if lib.exists():
            return lib
        try:  # an unwritable cache folder: build in the temporary folder instead
            lib.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)  # renamed when done
            break
        except OSError:
            if folder != cache_dir():
                raise
    os.close(fd)
    cmd = [*cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            said = res.stderr.strip()[-2000:]
            raise RuntimeError(f"{' '.join(cxx)} failed (exit status {res.returncode})"
                               + (f": {said}" if said else ""))
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
    start = time.perf_counter()
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxkvRaggedPagedAttention),
                                    platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        _error = str(e)
        return None
    build_info["seconds"] = time.perf_counter() - start
    return lib


def unavailable() -> str | None:
    """Why the "cpu" attention backend cannot run here (its kernel could not be built or
    loaded), as one line naming the argument; None when it can."""
    if load() is not None:
        return None
    return f"attention_backend cpu: its kernel cannot be built: {build_error()}"


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


def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           num_seqs, *, scale: float, layer: int | None = None, k_scale=None,
                           v_scale=None, kv_dtype: str | None = None):
    """Ragged paged attention on the CPU, reading the pool in place.

    Arguments, shapes and result as pallas_kernels.reference.ragged_paged_attention_reference:
    q float32 / bfloat16 / float16 [num_tokens, num_q_heads, head_dim] (head_dim <= 256,
    at most 32 query heads per KV head); k_cache, v_cache as stored (jaxkv.attention.kv_pool:
    float32 / float16, bfloat16 / float8 bits, int8), stacked [L, num_blocks, block_size,
    num_kv_heads, head_dim] with a static `layer`, or one layer's 4-D pool with layer None;
    kv_dtype names the values' type when the pool holds their bits; k_scale, v_scale: bfloat16
    scales (or their uint16 bits) [.., num_blocks, block_size, num_kv_heads] of a one-byte
    pool, else None; int32 block_tables [S, N], seq_lens [S], query_start_loc [S + 1]
    (starting at 0), num_seqs [1]. Returns [num_tokens, num_q_heads, head_dim] in q's dtype
    (float32 for a q of any other type), zeros past the last real sequence.

    Raises RuntimeError if the kernel is not built (load() is None), ValueError for an
    unsupported pool type; inconsistent arguments (a block id outside the pool, a context
    longer than its table, query_start_loc past num_tokens or decreasing, pools or scales of
    the wrong shape) fail the call with an XLA error naming "cpu attention", never a read
    out of bounds.
    """
    if load() is None:
        raise RuntimeError(f"cpu attention kernel unavailable: {build_error()}")
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
        k_scale, v_scale = (None, None) if k_scale is None else (k_scale[None], v_scale[None])
    kind, name = _kind(k_cache.dtype, kv_dtype)
    if kind == 3:
        lut = jnp.asarray(_lut(name))
        ks, vs = (jax.lax.bitcast_convert_type(s, jnp.uint16) if s.dtype != jnp.uint16 else s
                  for s in (k_scale, v_scale))
    else:
        lut = jnp.zeros((1,), jnp.float32)
        ks = vs = jnp.zeros((1,), jnp.uint16)
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        q = q.astype(jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, k_cache, v_cache, ks, vs, lut, i32(block_tables), i32(seq_lens),
                i32(query_start_loc), i32(num_seqs), layer=np.int64(layer),
                kind=np.int64(kind), scale=np.float32(scale))
