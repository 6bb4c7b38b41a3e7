"""Tensor parallelism: a 1-D device mesh ("tp") and where each array of the step lives on it.

Megatron-style, as vLLM lays a Llama out (Shoeybi et al. 2019): q/k/v and gate/up kernels are
split by output columns (heads), o and down by input rows, so each device computes its heads'
attention and its slice of the MLP, and XLA inserts the all-reduce after o_proj and down_proj
(GSPMD propagates the rest from these annotations: nothing home-made on the wire). Quantized
layers split the same way: their packed weights, per-group scales and zero points along the
same axis as the kernel, per-channel scales with the columns (jaxkv/quantization/linear.py).
A mixture of experts splits every expert's intermediate dimension as a dense MLP's (vLLM's
default; quantized experts' leaves with their weight's axis), or with expert parallelism
places whole experts per device; its router and a shared expert's gate are replicated. The
embedding and the LM head are split by vocabulary when it divides. The KV pool is split by KV
head; when there are fewer KV heads than devices (and the device count is a multiple of
them) K/V are replicated, as vLLM replicates them. Norms and everything of the host
(StepInput, block tables, sampler rows) are replicated: one block table serves every shard.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv.attention.kv_pool import split_by_kv_head

AXIS = "tp"


def check_device_count(n: int) -> None:
    """ValueError naming both numbers when there are fewer than n devices."""
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(f"tensor_parallel_size {n} needs {n} devices, found {len(devices)} "
                         f"{devices[0].platform} device(s) (on a CPU: "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n})")


def make_mesh(n: int) -> Mesh:
    """A mesh over the first n devices; ValueError naming both numbers when there are fewer."""
    check_device_count(n)
    return Mesh(np.asarray(jax.devices()[:n]), (AXIS,))


def kv_heads_split(cfg, mesh: Mesh | None) -> bool:
    """Whether the KV pool (and k/v projections) are split by KV head (else replicated)."""
    return mesh is not None and cfg.num_kv_heads % mesh.size == 0


def param_specs(params, cfg, mesh: Mesh, expert_parallel: bool = False):
    """PartitionSpecs of the LlamaModel parameter tree (jaxkv.models.llama names);
    expert_parallel: a mixture of experts' experts split whole over the mesh."""
    kv = kv_heads_split(cfg, mesh)
    vocab = cfg.vocab_size % mesh.size == 0
    cols = {"q_proj": True, "k_proj": kv, "v_proj": kv, "gate_proj": True, "up_proj": True,
            "shared_gate_proj": True, "shared_up_proj": True}
    rows = ("o_proj", "down_proj", "shared_down_proj")
    experts = {"gate_proj": P(None, None, AXIS), "up_proj": P(None, None, AXIS),
               "down_proj": P(None, AXIS, None)}  # [E, hidden, inter] / [E, inter, hidden]
    if expert_parallel:  # whole experts per device
        experts = dict.fromkeys(experts, P(AXIS, None, None))

    def spec(path, x):
        names = [str(getattr(p, "key", p)) for p in path]
        module, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
        if len(names) > 2 and names[-3] == "mlp" and module in experts:  # quantized experts
            return _quantized_expert_spec(module, leaf, x, expert_parallel)
        if leaf == "perm":  # GPTQ's act-order input permutation [in]
            return P()
        if module == "mlp":  # a mixture of experts: each expert's columns split (vLLM's default)
            return experts.get(leaf, P())
        if module in cols and cols[module]:  # [in, out] and [groups, out] leaves; [out] ones
            return P(None, AXIS) if x.ndim == 2 else P(AXIS)
        if module in rows and x.ndim == 2:  # the kernel, packed weights, groups' scales, zeros
            return P() if x.shape[0] == 1 else P(AXIS, None)  # one group: scales replicated
        if module == "embed_tokens" and vocab:  # [vocab, hidden]; gguf blocks [.., vocab]
            return P(AXIS, None) if leaf == "embedding" else P(None, AXIS)
        if module == "lm_head" and leaf == "kernel" and vocab:
            return P(None, AXIS)  # [hidden, vocab]
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def _quantized_expert_spec(module: str, leaf: str, x, expert_parallel: bool) -> P:
    """A quantized expert leaf [E, ...] (jaxkv/quantization/linear.py's leaves behind the
    expert axis) split as its float weight: whole experts per device with expert_parallel;
    else gate/up by output columns (the last axis: packed weights, scales, zero points, fp8
    kernels and per-channel scales [E, out]) and down by input rows (axis 1 of packed weights,
    groups' scales and zero points, fp8 kernels; per-channel scales and a single group's
    replicated). The act-order permutation [E, in] is replicated (experts' with them)."""
    if expert_parallel:
        return P(AXIS, *[None] * (x.ndim - 1))
    if leaf == "perm":
        return P()
    if module != "down_proj":
        return P(*[None] * (x.ndim - 1), AXIS)
    return P(None, AXIS, None) if x.ndim == 3 and x.shape[1] > 1 else P()


def param_shardings(params, cfg, mesh: Mesh, expert_parallel: bool = False):
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        param_specs(params, cfg, mesh, expert_parallel))


def place_params(params, cfg, tensor_parallel_size: int, expert_parallel: bool = False):
    """(mesh, params placed on it) for tensor parallelism; (None, params as given) on one
    device. Across processes JAX places host arrays only (each process keeps its own
    devices' slices), so the params are read to the host first there."""
    if tensor_parallel_size <= 1:
        return None, params
    mesh = make_mesh(tensor_parallel_size)
    if jax.process_count() > 1:
        params = jax.device_get(params)
    return mesh, jax.device_put(params, param_shardings(params, cfg, mesh, expert_parallel))


def kv_pool_specs(pool, cfg, mesh: Mesh):
    """PartitionSpecs of a KVPool: values [L, blocks, block_size, kv_heads, head_dim] and
    scales [L, blocks, block_size, kv_heads] split on kv_heads (or replicated)."""
    if kv_heads_split(cfg, mesh):
        return split_by_kv_head(pool, AXIS)
    return jax.tree.map(lambda x: P(), pool)


def kv_pool_shardings(pool, cfg, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), kv_pool_specs(pool, cfg, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def bytes_per_device(tree) -> list[int]:
    """Bytes each device holds of a pytree of arrays (for stats and tests)."""
    out: dict = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return [out[k] for k in sorted(out)]
