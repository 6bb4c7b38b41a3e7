"""Build and load jaxkv's C++ kernels for XLA:CPU (XLA FFI custom calls): the ragged paged
attention (attention.cc), the few-row matmul (linear.cc), the matmul of 17-128 rows (gemm.cc)
and the greedy argmax (argmax.cc), the sources next to this file, compiled together into one
library; the work sharing over XLA's thread pool that they all use is work_sharing.h.

Build: the sources are compiled once per machine with the system's C++ compiler (g++ or
$CXX; -O3 -march=native, against jaxlib's FFI headers, `jax.ffi.include_dir()`) into
~/.cache/jaxkv/kernels (JAXKV_KERNEL_CACHE=<dir> moves it; the temporary folder when that
cannot be written), keyed by the sources and headers, jaxlib's version, the compiler and the
CPU, written atomically, and loaded with ctypes: about 10 s the first time. `load()` returns
None and `build_error()` says why when no compiler is there or it fails; an engine asked for
"auto" then uses the xla backend (jaxkv/engine/setup.py).
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

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("attention.cc", "linear.cc", "gemm.cc", "argmax.cc"))
HEADERS = (_HERE / "work_sharing.h",)  # #include "work_sharing.h": found next to the sources
# XLA FFI target name -> the library's handler symbol
TARGETS = {"jaxkv_ragged_paged_attention": "JaxkvRaggedPagedAttention",
           "jaxkv_linear": "JaxkvLinear", "jaxkv_gemm": "JaxkvGemm", "jaxkv_argmax": "JaxkvArgmax"}
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


def _build(cxx: list[str], sources=None, headers=None) -> Path:
    """Compile `sources` (default SOURCES) into one library (or reuse a build with the same
    key: the text of the sources and of `headers`, default HEADERS, among the rest); returns
    the library's path. Raises RuntimeError with the compiler's message."""
    import jaxlib
    sources = SOURCES if sources is None else sources
    headers = HEADERS if headers is None else headers
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise RuntimeError(f"cannot run {' '.join(cxx)}: {e}") from e
    key = hashlib.sha256("\0".join([*(s.read_text() for s in (*sources, *headers)),
                                    jaxlib.__version__, version, " ".join(FLAGS),
                                    _cpu_identity()]).encode())
    name = f"jaxkv_kernels-{key.hexdigest()[:16]}.so"
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
    cmd = [*cxx, *FLAGS, "-I", jax.ffi.include_dir(), *map(str, sources), "-o", tmp]
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
    """Build (once per machine) and load the kernels, and register them with XLA for the
    CPU. Returns the library, or None when it cannot be built (see build_error())."""
    global _error
    cxx = _compiler()
    if cxx is None:
        _error = "no C++ compiler found (g++, c++ or $CXX)"
        return None
    start = time.perf_counter()
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(cxx)))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        _error = str(e)
        return None
    build_info["seconds"] = time.perf_counter() - start
    return lib


def build_error() -> str | None:
    """Why load() returned None (None when it has not failed)."""
    return _error


def unavailable() -> str | None:
    """Why the "cpu" backend cannot run here (its kernels could not be built or loaded), as
    one line naming the argument; None when it can."""
    if load() is not None:
        return None
    return f"attention_backend cpu: its kernels cannot be built: {build_error()}"
