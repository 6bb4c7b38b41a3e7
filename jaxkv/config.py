"""EngineArgs: every engine knob, with vLLM's names, validated once where it enters.

Nothing below the engine reads the CLI or the environment. EngineArgs only validates what it
is given and never rewrites it; `create_engine_config` resolves the defaults (for the platform
and the model) into a frozen EngineConfig that the scheduler, runner and engine read.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxkv.core.kv_budget import parse_bytes

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "pallas", "xla")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


def check_batched_tokens(max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """ValueError unless every running sequence can get a token in a step (vLLM's rule)."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than "
                         f"or equal to max_num_seqs ({max_num_seqs})")


@dataclass
class EngineArgs:
    """Engine arguments (names and meanings as vLLM's EngineArgs).

    model: None = the embedded SmolLM2-135M-Instruct GGUF; a .gguf file; or a Hugging Face
    model folder (config.json + *.safetensors + tokenizer files).
    max_model_len: None = the model's max_position_embeddings.
    max_num_batched_tokens: None = 512 on CPU, 8192 on GPU (token budget per step).
    kv_cache_memory_bytes: int or a string such as "1GiB"; sizing precedence is
    num_gpu_blocks_override, then kv_cache_memory_bytes, then gpu_memory_utilization (GPU), and
    exactly 1 GiB on CPU.
    token_buckets: padding sizes for the number of tokens in a step (None = powers of 8 below
    max_num_batched_tokens, then the budget: 1, 8, 64, 512); tests pass short lists.
    swap_space, tensor_parallel_size: reserved (only the defaults are supported).
    """
    model: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | str | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    load_format: str = "auto"
    attention_backend: str = "auto"
    max_logprobs: int = 20
    seed: int = 0
    swap_space: float = 0
    tensor_parallel_size: int = 1
    token_buckets: tuple[int, ...] | None = None

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        def pos_int(name, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be a positive integer")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        pos_int("block_size")
        if self.block_size & (self.block_size - 1):
            bad("block_size", "must be a power of two")
        pos_int("max_model_len", True)
        pos_int("max_num_seqs")
        pos_int("max_num_batched_tokens", True)
        pos_int("num_gpu_blocks_override", True)
        if self.max_num_batched_tokens is not None:
            check_batched_tokens(self.max_num_batched_tokens, self.max_num_seqs)
        if self.kv_cache_memory_bytes is not None and parse_bytes(self.kv_cache_memory_bytes) <= 0:
            bad("kv_cache_memory_bytes", "must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.load_format not in LOAD_FORMATS:
            bad("load_format", f"must be one of {LOAD_FORMATS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            bad("max_logprobs", "must be an integer >= 0")
        if not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if self.swap_space:
            bad("swap_space", "is reserved: swapping to host memory is not implemented yet (use 0)")
        if self.tensor_parallel_size != 1:
            bad("tensor_parallel_size", "is reserved: only 1 is supported yet")
        if self.token_buckets is not None:
            b = sorted(set(int(x) for x in self.token_buckets))
            if not b or b[0] < 1:
                bad("token_buckets", "must be a non-empty list of positive integers")

    def create_engine_config(self, *, platform: str, model_config=None,
                             device_memory_bytes: int | None = None):
        """Every value resolved once, frozen (jaxkv.engine_config.create_engine_config)."""
        from jaxkv.engine_config import create_engine_config
        return create_engine_config(self, platform=platform, model_config=model_config,
                                    device_memory_bytes=device_memory_bytes)
