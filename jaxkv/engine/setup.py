"""Building an engine from EngineArgs: load the checkpoint, size the KV pool, warm up."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("jaxkv")


def resolve_dtype(name: str, platform: str):
    import jax.numpy as jnp
    if name == "auto":
        return jnp.bfloat16 if platform == "gpu" else jnp.float32
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def resolve_max_model_len(args, model_config) -> int:
    limit = model_config.max_position_embeddings
    if args.max_model_len is None:
        return limit
    if args.max_model_len > limit:
        raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's maximum "
                         f"({limit} positions)")
    return args.max_model_len


def enable_compilation_cache() -> None:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so a second start
    of the same model and buckets skips most of the warmup. JAXKV_COMPILATION_CACHE=0 turns it
    off; JAXKV_COMPILATION_CACHE=<dir> moves it (default ~/.cache/jaxkv/xla)."""
    import os

    import jax
    where = os.environ.get("JAXKV_COMPILATION_CACHE", "")
    if where == "0" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir",
                      where or os.path.join(os.path.expanduser("~"), ".cache", "jaxkv", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_engine(cls, args):
    import jax
    import jax.numpy as jnp

    from jaxkv.attention import resolve_backend
    from jaxkv.config import CPU_MAX_NUM_BATCHED_TOKENS, GPU_MAX_NUM_BATCHED_TOKENS, check_batched_tokens
    from jaxkv.core.kv_budget import plan_kv_cache
    from jaxkv.core.kv_cache_manager import KVCacheManager
    from jaxkv.core.scheduler import Scheduler
    from jaxkv.loader.source import load_checkpoint
    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.models.params import dummy_params, params_from_tensors
    from jaxkv.runner.buckets import default_token_buckets
    from jaxkv.runner.model_runner import ModelRunner

    t0 = time.perf_counter()
    enable_compilation_cache()
    platform = jax.default_backend()
    ckpt = load_checkpoint(args.model, args.load_format)
    mc = ModelConfig.from_hf_config(ckpt.config)
    max_model_len = resolve_max_model_len(args, mc)
    if mc.sliding_window is not None and mc.sliding_window < max_model_len:
        raise ValueError(f"the model uses a sliding window of {mc.sliding_window} tokens, which jaxkv "
                         f"does not implement; set max_model_len <= {mc.sliding_window}")
    dtype = resolve_dtype(args.dtype, platform)
    backend = resolve_backend(args.attention_backend, platform)
    mnbt = args.max_num_batched_tokens or (GPU_MAX_NUM_BATCHED_TOKENS if platform == "gpu"
                                           else CPU_MAX_NUM_BATCHED_TOKENS)
    check_batched_tokens(mnbt, args.max_num_seqs)
    buckets = args.token_buckets or default_token_buckets(mnbt)
    if buckets[-1] < mnbt:
        raise ValueError(f"token_buckets {buckets} must reach max_num_batched_tokens={mnbt}")

    model = LlamaModel(mc, dtype=dtype, backend=backend)
    if args.load_format == "dummy":
        params = dummy_params(model, args.seed)
    else:
        params = params_from_tensors(model, ckpt.tensors)
    del ckpt.tensors
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))

    device_mem = None
    if platform == "gpu":
        stats = jax.devices()[0].memory_stats() or {}
        device_mem = stats.get("bytes_limit")
    budget = plan_kv_cache(
        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        dtype_bytes=jnp.dtype(dtype).itemsize, block_size=args.block_size,
        max_model_len=max_model_len, num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, device_memory_bytes=device_mem,
        used_memory_bytes=weight_bytes)
    logger.info(budget.log_line())

    runner = ModelRunner(model, params, num_blocks=budget.num_blocks, block_size=args.block_size,
                         max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                         token_buckets=buckets, max_logprobs=args.max_logprobs,
                         enforce_eager=args.enforce_eager)
    kv = KVCacheManager(budget.num_blocks, args.block_size, args.enable_prefix_caching)
    scheduler = Scheduler(kv, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=mnbt)
    logger.info("loaded %s (%s, %s, %.1f M params) in %.1f s", args.model or "SmolLM2-135M-Instruct",
                mc.architecture, jnp.dtype(dtype).name, weight_bytes / jnp.dtype(dtype).itemsize / 1e6,
                time.perf_counter() - t0)
    if not args.enforce_eager:
        secs, n = runner.warmup()
        logger.info("warmup compiled %d programs in %.1f s (token buckets %s)", n, secs, list(buckets))
    return cls(args, mc, ckpt.tokenizer, scheduler, runner, budget, max_model_len)
