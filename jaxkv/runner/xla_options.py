"""XLA options of the step programs, given to their jax.jit (and so to every compile of them),
so nothing else in the process changes.

On a GPU: `xla_gpu_dot_merger_threshold_mb=0`. XLA:GPU's DotMerger pass (hlo/transforms/
simplifiers/dot_merger.h in XLA) turns dots that share an operand, such as a layer's x @ W_q,
x @ W_k and x @ W_v, into one dot against the concatenation of their right-hand sides,
whenever one of them moves fewer bytes than the threshold (64 MiB in jaxlib 0.10.2:
Llama-3-8B's 8 MiB k_proj and v_proj weights qualify). On 2026-12-04's H200 that merged q/k/v
dot ran as one XLA Triton gemm fusion reading the three weights (the concatenation fused into
it, no copy of its own) at 1.9 TB/s, where cuBLAS read gate/up at 3.5 TB/s
(docs/performance.md). vLLM loads q/k/v (and gate/up) as one fused weight, which jaxkv does
too on a GPU (LlamaModel.fused_projections, float weights on one device): one dot over one
weight, and this option keeps the merger from joining the dots that stay apart (quantized
projections, a mixture of experts' shared expert and router).

On a GPU, also `xla_gpu_enable_command_buffer` = XLA's default command types
(XLA_DEFAULT_TYPES: jaxlib 0.10.2's, CONDITIONAL included; a test checks them against the
installed jaxlib) plus WHILE. XLA:GPU runs a loop of unknown trip count that is not inside a
command buffer (a CUDA graph) as a WhileThunk, which copies the loop's predicate to the host
and blocks the calling thread until the stream reaches it, every iteration
(xla/backends/gpu/runtime/while_thunk.cc; a conditional outside a graph does the same once,
conditional_thunk.cc). Multi-step decode's k-step program loops until its longest sequence's
steps are done (jaxkv/runner/multi_step.py): a wait per decode step. With WHILE a loop whose
body is all capturable becomes a CUDA graph conditional node, decided on the device, and the
host goes on; one that is not stays a thunk, as without the option. (Fused sampling's
`lax.switch`, jaxkv/sampling/fused_sampling.py, is captured by XLA's defaults when every
branch is capturable.)

With scanned layers (LlamaModel.scan_layers) each matmul reads a dynamic slice of a stacked
weight: `xla_gpu_enable_dynamic_slice_fusion` lets XLA hand cuBLAS the slice's address
instead of copying the slice out first (its DynamicSliceFusion; off by default in XLA).
Whether such a call inside a loop stays in the graph (DYNAMIC_SLICE_FUSION is a default
command type, but XLA may want the loop unrolled for it) is for a GPU run to show: the scan
variant's trace says what share of kernel time ran in graphs.

An option that XLA_FLAGS names is left to XLA_FLAGS (an experiment's choice wins), and other
platforms get none. The options were chosen with jaxlib 0.10.2; a jaxlib that refuses one
(a flag renamed or removed, a command type it does not know: XLA fails every compile that
names it) would fail every step program, so on a GPU they are first tried together on a
one-op program (once per process), and if XLA refuses one, each alone: an option refused is
dropped, and a command type refused is dropped from its list, each with a warning naming it
and XLA's words.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

logger = logging.getLogger("jaxkv")

# XLA's default command types (jaxlib 0.10.2), then the one that keeps the host going.
XLA_DEFAULT_TYPES = "CONDITIONAL,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,DYNAMIC_SLICE_FUSION,FUSION"
COMMAND_TYPES = XLA_DEFAULT_TYPES + ",WHILE"
GPU_STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0,
                    "xla_gpu_enable_command_buffer": COMMAND_TYPES}
SCAN_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": True}


def step_compiler_options(platform: str, xla_flags: str | None = None, scan: bool = False,
                          try_compile: Callable[[dict], None] | None = None) -> dict:
    """The compiler options of a step program on `platform` (jax's name: "gpu", "cpu", ...):
    GPU_STEP_OPTIONS (and SCAN_OPTIONS for a model whose layers are scanned) on a GPU, less
    those `xla_flags` (default: $XLA_FLAGS) sets, less what `try_compile` refuses
    (accepted_options; default: compile_one_op, its answer kept for the process); {}
    elsewhere."""
    if platform != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    wanted = {**GPU_STEP_OPTIONS, **(SCAN_OPTIONS if scan else {})}
    wanted = {k: v for k, v in wanted.items() if f"--{k}=" not in flags}
    if try_compile is None:
        return dict(_accepted_here(tuple(wanted.items())))
    return accepted_options(wanted, try_compile)


@functools.lru_cache(maxsize=None)
def _accepted_here(options: tuple) -> tuple:
    return tuple(accepted_options(dict(options), compile_one_op).items())


def compile_one_op(options: dict) -> None:
    """Compile a one-op program with `options` on the default device; raises what XLA raises."""
    import jax
    import jax.numpy as jnp
    jax.jit(lambda x: x + 1, compiler_options=options).lower(jnp.zeros(1, jnp.float32)).compile()


# How XLA refuses a compile option (CompileOptions::ApplyOption): an unknown name, or a value
# it cannot parse ("While setting option X, 'Y' is not a valid enum value.").
REFUSALS = ("No such compile option", "While setting option")


def _refused(error: Exception, name: str | None = None) -> bool:
    msg = str(error)
    return any(r in msg for r in REFUSALS) and (name is None or name in msg)


def accepted_options(options: dict, try_compile: Callable[[dict], None]) -> dict:
    """`options` less what XLA refuses: all tried at once by `try_compile`; when XLA refuses
    one of them (REFUSALS), each alone (_accepted_value). Any other failure, or a refusal
    that names none of the options, is raised."""
    if not options:
        return {}
    try:
        try_compile(options)
        return dict(options)
    except Exception as e:  # (jax's JaxRuntimeError; XLA says INVALID_ARGUMENT)
        if not _refused(e):
            raise
    kept = {name: _accepted_value(name, value, try_compile) for name, value in options.items()}
    return {name: value for name, value in kept.items() if value is not None}


def _accepted_value(name: str, value, try_compile: Callable[[dict], None]):
    """`value` as XLA takes it for option `name` alone, or None (refused). A comma-separated
    list loses the items XLA names as invalid, one refusal at a time (a command type this
    jaxlib lacks: the others, WHILE among them, stay); each drop is warned of, with XLA's
    message."""
    while True:
        try:
            try_compile({name: value})
            return value
        except Exception as e:
            if not _refused(e, name):
                raise
            msg = str(e).splitlines()[0]
        items = value.split(",") if isinstance(value, str) else []
        bad = [x for x in items if f"'{x}'" in msg]
        if bad and len(bad) < len(items):
            value = ",".join(x for x in items if x not in bad)
            logger.warning("XLA option %s: %s refused by this jaxlib (%s): the step programs "
                           "compile without it", name, ",".join(bad), msg)
            continue
        logger.warning("XLA option %s=%s refused by this jaxlib (%s): the step programs "
                       "compile without it", name, value, msg)
        return None
