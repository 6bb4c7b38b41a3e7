"""jaxkv's C++ kernels for XLA:CPU, their build and their Python wrappers, in one package.

Four XLA FFI custom calls, compiled together on first use into one library (build.py: g++ or
$CXX, cached per machine, registered with XLA for the CPU):

- attention.cc / attention.py: the ragged paged attention of the "cpu" attention backend
  (jaxkv.attention), reading K/V blocks in place from the pool;
- linear.cc, gemm.cc / linear.py: the matmuls of a decode step's rows (LlamaModel.cpu_matmul):
  the streaming kernel up to 16 rows, the register-blocked GEMM from 17 to 128;
- argmax.cc / argmax.py: the greedy argmax of the sampler programs
  (jaxkv.sampling.sampler.argmax_tokens with cpu=True).

All four share their work items among the calling thread and tasks on XLA's intra-op thread
pool the same way, written once in work_sharing.h (jaxkv::RunShared).

The package re-exports the build's public names: `load()` (build once, load, register; None
when it cannot), `build_error()`, `unavailable()` (why the "cpu" backend cannot run here) and
`build_info`. The wrappers are imported as submodules (`from jaxkv.cpu_kernels import
linear`); importing the package loads neither them nor the library.
"""

from jaxkv.cpu_kernels.build import build_error, build_info, cache_dir, load, unavailable

__all__ = ["build_error", "build_info", "cache_dir", "load", "unavailable"]
