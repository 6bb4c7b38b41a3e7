"""KV-cache sizing: bytes per token, blocks from a memory budget, maximum concurrency.

Plain arithmetic, no JAX. bytes per token = 2 (K and V) x num_layers x num_kv_heads x head_dim
x dtype bytes: KV heads, not attention heads (grouped-query attention stores fewer).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

DEFAULT_CPU_KV_BYTES = 1 << 30  # exactly 1 GiB on CPU

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str | int) -> int:
    """'1GiB' -> 1073741824, '512MiB', '2e9', '1000' -> bytes. ValueError on anything else."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory_bytes: cannot parse {text!r} (use e.g. 1073741824, 1GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class KVBudget:
    bytes_per_token: int
    block_size: int
    num_blocks: int  # blocks in the pool, null block included
    num_tokens: int
    max_model_len: int
    max_concurrency: float  # requests of max_model_len tokens that fit at once

    def to_dict(self) -> dict:
        return asdict(self)

    def log_line(self) -> str:
        return (f"KV cache: {self.bytes_per_token:,} bytes per token, {self.num_blocks:,} blocks of "
                f"{self.block_size} tokens = {self.num_tokens:,} tokens; maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                    scale_bytes: int = 0) -> int:
    """K and V of one token in every layer: head_dim values of dtype_bytes per KV head, plus
    scale_bytes per KV head for a quantized pool (jaxkv/attention/kv_pool.py)."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def plan_kv_cache(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                  scale_bytes: int = 0,
                  block_size: int, max_model_len: int, num_gpu_blocks_override: int | None = None,
                  kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                  device_memory_bytes: int | None = None, used_memory_bytes: int = 0) -> KVBudget:
    """Blocks from a budget, in vLLM's precedence: num_gpu_blocks_override, then
    kv_cache_memory_bytes, then gpu_memory_utilization x device memory minus what is already
    used (weights), and on a device with no known memory (CPU) exactly 1 GiB.

    Raises ValueError when the budget holds fewer than 2 blocks.
    """
    bpt = bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes, scale_bytes)
    block_bytes = bpt * block_size
    if num_gpu_blocks_override is not None:
        num_blocks = int(num_gpu_blocks_override)
    else:
        if kv_cache_memory_bytes is not None:
            budget = int(kv_cache_memory_bytes)
        elif device_memory_bytes is not None:
            budget = int(device_memory_bytes * gpu_memory_utilization) - used_memory_bytes
        else:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ValueError(f"KV cache budget holds {num_blocks} blocks of {block_bytes:,} bytes; need at least 2 "
                         "(raise kv_cache_memory_bytes or num_gpu_blocks_override)")
    num_tokens = num_blocks * block_size
    return KVBudget(bpt, block_size, num_blocks, num_tokens, max_model_len, num_tokens / max_model_len)
