"""EngineConfig: every value the engine runs with, resolved once from EngineArgs and frozen.

`create_engine_config` (also `EngineArgs.create_engine_config`, vLLM's name) is the one place
where defaults meet the platform and the model: max_model_len from the model, the dtype and
attention backend for the platform, the token budget and its buckets (and which of them
compile before the engine is ready), and the number of KV blocks. The scheduler, the runner,
the engine and `jaxkv plan` all read the same record, so `jaxkv plan` reports what
`jaxkv serve` would allocate. Plain Python: no JAX import here.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from jaxkv.core.kv_budget import KVBudget, bytes_per_token, parse_bytes, plan_kv_cache
from jaxkv.core.spec_decode import SpeculativeConfig
from jaxkv.structured_outputs.params import StructuredOutputsConfig
from jaxkv.models.model_config import ModelConfig
from jaxkv.quantization import QuantSpec, check_layer_shapes, weights_bytes
from jaxkv.quantization import check_tensor_parallel as check_quantized_split
from jaxkv.quantization import resolve as resolve_quantization

logger = logging.getLogger("jaxkv")

ATTENTION_BACKENDS = ("auto", "cpu", "pallas", "xla")
CPU_MAX_NUM_BATCHED_TOKENS = 512   # 2 CPU cores: 512 rows keep a step near the matmul peak
GPU_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's usual default for online serving
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1}
KV_CACHE_DTYPE_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# Quantized (one-byte) pool dtypes -> bytes of the scale stored per token and KV head (a
# bfloat16: kv_pool.SCALE_DTYPE; tests/attention/test_kv_pool_bytes.py holds the two together).
KV_SCALE_BYTES = {"int8": 2, "float8_e4m3fn": 2, "float8_e5m2": 2}


def check_batched_tokens(max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """ValueError unless every running sequence can get a token in a step (vLLM's rule)."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than "
                         f"or equal to max_num_seqs ({max_num_seqs})")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int              # tokens per block
    num_blocks: int              # blocks in the pool, the null block included
    enable_prefix_caching: bool
    budget: KVBudget             # the sizing behind num_blocks (bytes per token, concurrency)
    # The lower tiers (jaxkv/core/host_tier.py, disk_tier.py): whole blocks (all KV heads).
    block_bytes: int = 0         # one block of every layer, K and V (and scales), all heads
    num_host_blocks: int = 0     # swap_space / kv_offloading_size in blocks (0: no host tier)
    kv_cache_disk_dir: str | None = None
    kv_cache_disk_bytes: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int  # token budget of one step
    max_model_len: int           # prompt + output tokens of one request
    preemption_mode: str = "recompute"  # or "swap" (through the host tier)
    # Slots allocated past a sampling request's tokens when they cost no preemption (async
    # scheduling: the step dispatched ahead writes its next token there; vLLM's lookahead)
    num_lookahead_tokens: int = 0
    # Multi-step decode (jaxkv/runner/multi_step.py): decode steps one engine step may run
    num_scheduler_steps: int = 1


@dataclass(frozen=True)
class RunnerConfig:
    dtype: str                   # "float32" | "bfloat16" | "float16" (resolved from "auto")
    attention_backend: str       # "cpu" | "xla" | "pallas" (resolved from "auto")
    token_buckets: tuple[int, ...]  # padded token counts of a step, ascending; last >= budget
    max_logprobs: int
    enforce_eager: bool
    # The token buckets compiled before the engine is ready (a subset of token_buckets holding
    # one >= the budget); the others compile in a background thread after warmup.
    warmup_token_buckets: tuple[int, ...]
    # The KV pool's dtype (a jnp dtype name: the weights' dtype, or narrower with kv_cache_dtype).
    kv_cache_dtype: str = "float32"
    tensor_parallel_size: int = 1  # devices of the mesh the step is split over
    num_processes: int = 1  # processes holding those devices (jaxkv/runner/multiprocess.py)
    # Dispatch the next decode step before this step's tokens reach the host
    # (jaxkv/runner/lookahead.py); one process without a mesh only.
    async_scheduling: bool = False
    # The decoder layers' weights quantized (jaxkv/quantization), None: in `dtype`.
    quantization: QuantSpec | None = None
    # A mixture of experts' experts placed whole per device (else each expert's columns split).
    expert_parallel: bool = False
    scan_layers: bool = False  # the decoder layers as one scan (LlamaModel.scan_layers)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None            # None = the embedded SmolLM2-135M-Instruct
    load_format: str
    seed: int
    platform: str                # jax.default_backend() of the engine: "cpu" | "gpu" | ...
    model_config: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len


def check_tensor_parallel(cfg, n: int) -> None:
    """ValueError in one line when no layout splits the model's heads over `n` devices."""
    if n == 1:
        return
    if cfg.num_heads % n:
        raise ValueError(f"tensor_parallel_size {n} must divide num_attention_heads "
                         f"({cfg.num_heads})")
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {n} and num_key_value_heads ({cfg.num_kv_heads}) "
                         "must divide one another (KV heads are split, or replicated when fewer)")
    if cfg.intermediate_size % n and len(cfg.moe_layers) < cfg.num_layers:  # a dense MLP to split
        raise ValueError(f"tensor_parallel_size {n} must divide intermediate_size "
                         f"({cfg.intermediate_size})")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name) % n:
            raise ValueError(f"tensor_parallel_size {n} must divide {name} ({getattr(cfg, name)})")


def kv_heads_per_device(cfg, n: int) -> int:
    """KV heads each of n tensor-parallel devices holds: its share, or all when they are
    replicated (fewer KV heads than devices)."""
    return cfg.num_kv_heads // n if cfg.num_kv_heads % n == 0 else cfg.num_kv_heads


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of 2 below the budget, then the budget: (1, 2, 4, ..., 256, 512) for 512 tokens.

    Padding is expensive on a CPU: the weight matmuls of a whole 30-layer SmolLM2 step cost
    about 21 ms at 1 row, 34 at 8, 41 at 16, 56 at 32, 78 at 64 and 433 at 512 (2 cores), so a
    step pads to at most twice its tokens. Each bucket is one compiled program of ~8-10 s, so
    only the coarse ones (`coarse_token_buckets`) are compiled before the engine is ready; the
    others compile in a background thread and are used once they land.
    """
    out, b = [], 1
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    out.append(max_num_batched_tokens)
    return tuple(out)


def coarse_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of 8 below the budget, then the budget: (1, 8, 64, 512) for 512 tokens, the
    default warmup buckets. Four programs keep the cold start under a minute on 2 cores and
    still fit the common steps: 1 is a lone decode, 8 and 64 decode batches, and steps that
    carry a prefill chunk often fill the budget."""
    out, b = [], 1
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 8
    out.append(max_num_batched_tokens)
    return tuple(out)


def resolve_token_buckets(token_buckets, warmup_token_buckets, max_num_batched_tokens: int):
    """(token_buckets, warmup_token_buckets), sorted and deduplicated.

    Neither given: powers of 2 (`default_token_buckets`), the coarse ones at warmup. Explicit
    token_buckets alone are all compiled at warmup. Explicit warmup_token_buckets must be among
    token_buckets and hold one >= max_num_batched_tokens, so that every step has a compiled
    bucket from the start. ValueError naming the field otherwise."""
    mnbt = max_num_batched_tokens
    buckets = (tuple(sorted(set(int(x) for x in token_buckets))) if token_buckets
               else default_token_buckets(mnbt))
    if buckets[-1] < mnbt:
        raise ValueError(f"token_buckets {buckets} must reach max_num_batched_tokens={mnbt}")
    if warmup_token_buckets:
        warm = tuple(sorted(set(int(x) for x in warmup_token_buckets)))
        stray = [b for b in warm if b not in buckets]
        if stray:
            raise ValueError(f"warmup_token_buckets {warm}: {stray[0]} is not one of token_buckets "
                             f"{buckets}")
        if warm[-1] < mnbt:
            raise ValueError(f"warmup_token_buckets {warm} must hold a bucket >= "
                             f"max_num_batched_tokens={mnbt}, so that every step has a compiled "
                             "program from the start")
    elif token_buckets:
        warm = buckets
    else:
        warm = coarse_token_buckets(mnbt)
    return buckets, warm


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """vLLM's --kv-cache-dtype -> the pool's jnp dtype name: auto = the weights' `dtype`;
    fp8 / fp8_e4m3 -> float8_e4m3fn, fp8_e5m2 -> float8_e5m2, int8 stays. A pool never wider than the
    weights (bfloat16 weights keep a bfloat16 pool for "auto")."""
    if kv_cache_dtype == "auto":
        return dtype
    return KV_CACHE_DTYPE_NAMES.get(kv_cache_dtype, kv_cache_dtype)


def resolve_backend(name: str, platform: str, model_config: ModelConfig | None = None,
                    tensor_parallel_size: int = 1,
                    cpu_kernels_unavailable: Callable[[], str | None] | None = None) -> str:
    """The attention backend: auto -> "pallas" on a GPU, "cpu" on a CPU, "xla" elsewhere (pallas
    off a GPU runs in interpret mode), checked against what the machine and the layout allow.

    A kernel run per device (pallas, cpu) needs the KV heads split over a tensor-parallel mesh
    (num_kv_heads divisible by tensor_parallel_size); the cpu kernel runs on a CPU only and
    needs its C++ build: `cpu_kernels_unavailable()` says why it cannot run (None: it can;
    jaxkv.cpu_kernels.unavailable, which builds it on first call; not asked when None is given,
    as `jaxkv plan` does). An "auto" that would be "cpu" falls back to "xla" with a warning;
    otherwise a ValueError says why, as it does for an unknown name.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    backend = {"gpu": "pallas", "cpu": "cpu"}.get(platform, "xla") if name == "auto" else name
    tp, why = tensor_parallel_size, None
    if backend == "cpu" and platform != "cpu":
        why = f"attention_backend cpu runs on a CPU only, not on {platform} (use pallas or xla)"
    elif backend in ("pallas", "cpu") and tp > 1 and model_config.num_kv_heads % tp:
        why = (f"attention_backend {backend} with tensor_parallel_size {tp} needs the KV heads "
               f"({model_config.num_kv_heads}) split over the devices, not replicated (use the "
               "xla backend)")
    elif backend == "cpu" and cpu_kernels_unavailable is not None:
        why = cpu_kernels_unavailable()
    if why is None:
        return backend
    if name == "auto" and backend == "cpu":
        logger.warning("%s; using the xla attention backend", why)
        return "xla"
    raise ValueError(why)


def create_engine_config(args, *, platform: str, model_config: ModelConfig | None = None,
                         device_memory_bytes: int | None = None, num_processes: int = 1,
                         cpu_kernels_unavailable: Callable[[], str | None] | None = None,
                         quantization_config: dict | None = None) -> EngineConfig:
    """Resolve `args` (EngineArgs) for `platform`, the model and the job, once: the engine build
    uses the result as it is.

    model_config: the checkpoint's ModelConfig (read from args.model when None).
    device_memory_bytes: the accelerator's memory, for gpu_memory_utilization sizing (the
    weights' share is the model's parameter count x dtype bytes).
    num_processes: the processes of the job that will run the engine (jax.process_count()).
    cpu_kernels_unavailable: see `resolve_backend` (None: the cpu kernel is assumed to build).
    quantization_config: the checkpoint's (config.json's), with args.quantization deciding
    the weights' format (read from args.model with model_config when None).
    Raises ValueError naming the field for values that contradict the model, the platform, the
    job or each other.
    """
    if model_config is None:
        from jaxkv.loader.source import read_config
        hf_config = read_config(args.model)
        model_config = ModelConfig.from_hf_config(hf_config)
        quantization_config = hf_config.get("quantization_config")
    mc = model_config
    quant = resolve_quantization(args.quantization, {"quantization_config": quantization_config},
                                 platform)
    max_model_len = _max_model_len(args.max_model_len, mc)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if platform == "gpu" else "float32")
    mnbt = args.max_num_batched_tokens or (GPU_MAX_NUM_BATCHED_TOKENS if platform == "gpu"
                                           else CPU_MAX_NUM_BATCHED_TOKENS)
    check_batched_tokens(mnbt, args.max_num_seqs)
    buckets = resolve_token_buckets(args.token_buckets, args.warmup_token_buckets, mnbt)
    speculative = SpeculativeConfig.from_value(args.speculative_config)
    if speculative is not None and speculative.num_speculative_tokens >= mnbt:
        raise ValueError(f"speculative_config.num_speculative_tokens ({speculative.num_speculative_tokens}) "
                         f"must be less than max_num_batched_tokens ({mnbt}): a draft shares the "
                         "step's token budget with its request's own token")
    _check_layout(args, mc, quant)
    if (quant is not None and platform == "gpu" and quant.bits == 4 and num_processes == 1
            and args.tensor_parallel_size == 1 and quant.method != "gguf"):
        quant = dataclasses.replace(quant, int4_kernel=True)  # pallas_kernels/int4_matmul.py
    cache = _cache_config(args, mc, dtype, max_model_len, device_memory_bytes, quant)
    if num_processes > 1 and cache.num_host_blocks:  # also when the job came from JAX's environment
        raise ValueError("swap_space is not supported by a multi-process engine yet")
    if num_processes > 1 and args.async_scheduling:
        raise ValueError("async_scheduling is not supported by a multi-process engine yet")
    runner = dataclasses.replace(_runner_config(args, mc, platform, dtype, buckets, speculative,
                                                num_processes, cpu_kernels_unavailable),
                                 quantization=quant, expert_parallel=args.enable_expert_parallel,
                                 scan_layers=args.scan_layers)
    _check_scan(args, mc, quant, runner)
    return EngineConfig(
        model=args.model, load_format=args.load_format, seed=args.seed, platform=platform,
        model_config=mc, cache=cache,
        scheduler=SchedulerConfig(args.max_num_seqs, mnbt, max_model_len, args.preemption_mode,
                                  num_lookahead_tokens=int(runner.async_scheduling) * args.num_scheduler_steps,
                                  num_scheduler_steps=args.num_scheduler_steps),
        runner=runner,
        speculative=speculative,
        structured_outputs=StructuredOutputsConfig.from_value(args.structured_outputs_config))


def _check_scan(args, mc: ModelConfig, quant: QuantSpec | None, runner: RunnerConfig) -> None:
    """ValueError in one line: ModelConfig.scan_refusal for scan_layers, or the cpu backend."""
    many = runner.tensor_parallel_size > 1 or max(runner.num_processes, args.num_processes or 1) > 1
    why = args.scan_layers and (mc.scan_refusal(quant is not None, many) or (
        runner.attention_backend == "cpu" and "the cpu attention backend (auto's choice on a CPU) "
        "takes its layer as a constant; pick attention_backend xla or pallas"))
    if why:
        raise ValueError(f"scan_layers: {why}")


def _check_layout(args, mc: ModelConfig, quant: QuantSpec | None) -> None:
    """ValueError in one line when the model's weights cannot be laid out as asked: heads,
    columns, int4 groups or experts a tensor-parallel mesh cannot split, quantized experts."""
    tp = args.tensor_parallel_size
    check_tensor_parallel(mc, tp)
    check_quantized_split(quant, mc, tp, args.enable_expert_parallel)
    if args.enable_expert_parallel and not mc.num_experts:
        raise ValueError(f"enable_expert_parallel: {mc.architecture} has no experts")
    if args.enable_expert_parallel and mc.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp} must divide "
                         f"num_experts ({mc.num_experts})")
    if quant is not None and mc.num_experts and quant.method == "gguf":
        raise ValueError(f"quantization {quant.name!r}: quantized experts ({mc.architecture}) "
                         "in GGUF blocks are not kept yet (leave quantization unset: float weights)")
    check_layer_shapes(quant, mc)


def _max_model_len(asked: int | None, mc: ModelConfig) -> int:
    """The model's limit unless a smaller one is asked; ValueError beyond it."""
    limit = mc.max_position_embeddings
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's maximum ({limit} positions)")
    return asked or limit


def _runner_config(args, mc: ModelConfig, platform: str, dtype: str, token_buckets: tuple,
                   speculative: SpeculativeConfig | None, num_processes: int,
                   cpu_kernels_unavailable) -> RunnerConfig:
    buckets, warmup_buckets = token_buckets
    tp = args.tensor_parallel_size
    backend = resolve_backend(args.attention_backend, platform, mc, tp, cpu_kernels_unavailable)
    processes = max(num_processes, args.num_processes or 1)
    return RunnerConfig(dtype, backend, buckets, args.max_logprobs, args.enforce_eager,
                        warmup_buckets, resolve_kv_cache_dtype(args.kv_cache_dtype, dtype), tp,
                        num_processes=num_processes,
                        async_scheduling=(args.async_scheduling is not False and speculative is None
                                          and tp == 1 and processes == 1))


def _cache_config(args, mc: ModelConfig, dtype: str, max_model_len: int,
                  device_memory_bytes: int | None, quant: QuantSpec | None) -> CacheConfig:
    """The KV pool's blocks (per device, as vLLM's budgets: with tensor parallelism a device
    holds its KV heads only, all of them when they are replicated) and the lower tiers."""
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    kv_bytes = None if args.kv_cache_memory_bytes is None else parse_bytes(args.kv_cache_memory_bytes)
    tp = args.tensor_parallel_size
    budget = plan_kv_cache(
        num_layers=mc.num_layers, num_kv_heads=kv_heads_per_device(mc, tp), head_dim=mc.head_dim,
        dtype_bytes=DTYPE_BYTES[kv_dtype], scale_bytes=KV_SCALE_BYTES.get(kv_dtype, 0),
        block_size=args.block_size, max_model_len=max_model_len,
        num_gpu_blocks_override=args.num_gpu_blocks_override, kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, device_memory_bytes=device_memory_bytes,
        used_memory_bytes=weights_bytes(mc, DTYPE_BYTES[dtype], quant) // tp)
    block_bytes = bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, DTYPE_BYTES[kv_dtype],
                                  KV_SCALE_BYTES.get(kv_dtype, 0)) * args.block_size
    host_bytes = args.host_tier_bytes()
    if host_bytes and host_bytes < block_bytes:
        raise ValueError(f"swap_space ({host_bytes} bytes) holds no KV block of this model "
                         f"({block_bytes} bytes)")
    ram = host_memory_bytes()
    if ram and host_bytes > 0.7 * ram:  # vLLM's limit for its swap space
        raise ValueError(f"swap_space ({host_bytes / 2**30:.1f} GiB) is more than 70% of this "
                         f"machine's memory ({ram / 2**30:.1f} GiB)")
    disk_bytes = 0 if args.kv_cache_disk_bytes is None else parse_bytes(args.kv_cache_disk_bytes)
    if args.kv_cache_disk_dir is not None and disk_bytes < block_bytes + 8:
        raise ValueError(f"kv_cache_disk_bytes ({disk_bytes}) holds no KV block of this model "
                         f"({block_bytes + 8} bytes per file)")
    return CacheConfig(args.block_size, budget.num_blocks, args.enable_prefix_caching, budget,
                       block_bytes, host_bytes // block_bytes, args.kv_cache_disk_dir, disk_bytes)


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    import os
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_tier_capacities(config: EngineConfig) -> dict:
    """The lower KV tiers' capacities: {"host"|"disk": {"blocks", "tokens", "requests" (at
    max_model_len tokens each)}}, only the tiers that are on. A disk file holds one block
    plus an 8-byte trailer (jaxkv/core/disk_tier.py)."""
    cc, out = config.cache, {}
    disk_blocks = cc.kv_cache_disk_bytes // (cc.block_bytes + 8) if cc.kv_cache_disk_dir else 0
    for name, blocks in (("host", cc.num_host_blocks), ("disk", disk_blocks)):
        if blocks:
            out[name] = {"blocks": blocks, "tokens": blocks * cc.block_size,
                         "requests": round(blocks * cc.block_size / config.max_model_len, 4)}
    return out
