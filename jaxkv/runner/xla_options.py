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

On a GPU, also `xla_gpu_enable_command_buffer` = XLA's default command types plus CONDITIONAL
and WHILE. XLA:GPU runs a conditional that is not inside a command buffer (a CUDA graph) as
a ConditionalThunk, and a loop of unknown trip count as a WhileThunk: each copies its
predicate to the host and blocks the calling thread until the stream reaches it
(`stream.BlockHostUntilDone()`, xla/backends/gpu/runtime/conditional_thunk.cc and
while_thunk.cc in XLA). Every step program that fuses sampling has one such conditional, the
`lax.switch` on StepInput.sample_mode (jaxkv/sampling/fused_sampling.py), after the model:
so enqueueing step N would wait for step N's forward pass to finish on the device, and step
N + 1's enqueueing (3.3-5.5 ms of host time per step on 2026-12-04's H200) could not overlap
step N on the device. Multi-step decode's loop runs until its longest sequence's steps are
done (jaxkv/runner/multi_step.py), a wait per iteration. XLA's default command types leave
both out (xla/debug_options_flags.cc); with them in, a conditional or loop whose branches and
body are all capturable becomes a CUDA graph conditional node, decided on the device, and the
host goes on. One that is not capturable stays a thunk, as without the option.

An option that XLA_FLAGS names is left to XLA_FLAGS (an experiment's choice wins), and other
platforms get none.
"""

from __future__ import annotations

import os

# XLA's default command types (jax 0.10-0.11), then the two that keep the host going.
COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,CONDITIONAL,WHILE"
GPU_STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0,
                    "xla_gpu_enable_command_buffer": COMMAND_TYPES}


def step_compiler_options(platform: str, xla_flags: str | None = None) -> dict:
    """The compiler options of a step program on `platform` (jax's name: "gpu", "cpu", ...):
    GPU_STEP_OPTIONS on a GPU less those `xla_flags` (default: $XLA_FLAGS) sets; {} elsewhere."""
    if platform != "gpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {k: v for k, v in GPU_STEP_OPTIONS.items() if f"--{k}=" not in flags}
