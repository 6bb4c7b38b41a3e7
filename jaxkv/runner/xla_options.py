"""XLA options of the step programs, given to their jax.jit (and so to every compile of them),
so nothing else in the process changes.

On a GPU: `xla_gpu_dot_merger_threshold_mb=0`. XLA:GPU's DotMerger pass (hlo/transforms/
simplifiers/dot_merger.h in XLA) turns dots that share an operand, such as a layer's
x @ W_q, x @ W_k and x @ W_v, into one dot against the concatenation of their right-hand
sides, whenever one of them moves fewer bytes than the threshold (32 MiB by default: Llama-3-8B's
8 MiB k_proj and v_proj weights qualify). Weights are the program's parameters, so that
concatenation is a copy made on every step: 48 MiB read and written more per layer at 8B
shapes, ~3 GiB per step over 32 layers, ~0.7 ms at the H200's 4.45 TB/s, where the whole
weight read at batch 1 takes 3.6 ms. vLLM's answer is to load q/k/v (and gate/up) as one
fused weight, which jaxkv does too on a GPU (LlamaModel.fused_projections, float weights on
one device): the merger then has nothing of theirs to concatenate, and this option keeps it
from concatenating the dots that stay apart (quantized projections, a mixture of experts'
shared expert and router).

An option that XLA_FLAGS names is left to XLA_FLAGS (an experiment's choice wins), and other
platforms get none.
"""

from __future__ import annotations

import os

GPU_STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def step_compiler_options(platform: str, xla_flags: str | None = None) -> dict:
    """The compiler options of a step program on `platform` (jax's name: "gpu", "cpu", ...):
    GPU_STEP_OPTIONS on a GPU less those `xla_flags` (default: $XLA_FLAGS) sets; {} elsewhere."""
    if platform != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in GPU_STEP_OPTIONS.items() if f"--{k}=" not in flags}
