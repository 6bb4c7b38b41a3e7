"""Building an engine from EngineArgs: load the checkpoint, resolve the EngineConfig (KV pool
size included), build the model, runner and scheduler from it, warm up (the warmup token
buckets), and start the background compiler of the other buckets."""

from __future__ import annotations

import logging
import time
import weakref

logger = logging.getLogger("jaxkv")


def device_memory_bytes(platform: str) -> int | None:
    """The accelerator's memory limit (for gpu_memory_utilization); None on a CPU."""
    if platform != "gpu":
        return None
    import jax
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


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


def log_attention_backend(backend: str) -> None:
    if backend == "cpu":
        from jaxkv import cpu_kernels
        info = cpu_kernels.build_info
        logger.info("attention backend: cpu (C++ ragged paged attention, %s in %.1f s)",
                    "loaded" if info.get("cached") else "compiled", info.get("seconds", 0.0))
    else:
        logger.info("attention backend: %s", backend)


def cpu_matmul_wanted(runner_config, mesh) -> bool:
    """Whether the model runs its few-row matmuls through jaxkv's C++ kernel
    (jaxkv/models/cpu_linear.py): with the (resolved) cpu attention backend, float32 weights
    and one device (a tensor-parallel mesh keeps XLA's partitioned dots)."""
    return (runner_config.attention_backend == "cpu" and runner_config.dtype == "float32"
            and mesh is None)


def kv_tiers(config, args):
    """The KV cache's host and disk tiers (or None, None): the host side's bookkeeping."""
    cc = config.cache
    if not cc.num_host_blocks:
        return None, None
    from jaxkv.core.disk_tier import DiskTier, fingerprint_files
    from jaxkv.core.host_tier import HostTier
    host, disk = HostTier(cc.num_host_blocks), None
    if cc.kv_cache_disk_dir is not None:
        from jaxkv.loader.gguf import embedded_model_path
        mc, rc = config.model_config, config.runner
        weights = (f"dummy:{args.seed}" if args.load_format == "dummy"
                   else fingerprint_files(args.model or embedded_model_path()))
        identity = {"weights": weights, "architecture": mc.architecture, "dtype": rc.dtype,
                    "kv_cache_dtype": rc.kv_cache_dtype, "block_size": cc.block_size,
                    "num_layers": mc.num_layers, "num_kv_heads": mc.num_kv_heads,
                    "head_dim": mc.head_dim}
        disk = DiskTier(cc.kv_cache_disk_dir, cc.kv_cache_disk_bytes, cc.block_bytes, identity)
    logger.info("KV cache tiers: host %d blocks (%.2f GiB)%s", cc.num_host_blocks,
                cc.num_host_blocks * cc.block_bytes / 2**30,
                f", disk {disk.max_blocks} blocks ({disk.num_used} found) in {disk.dir}" if disk else "")
    return host, disk


def build_engine(cls, args):
    import jax
    import jax.numpy as jnp

    from jaxkv import cpu_kernels
    from jaxkv.attention import get_attention
    from jaxkv.core.kv_cache_manager import KVCacheManager
    from jaxkv.core.scheduler import Scheduler
    from jaxkv.core.structured_output import StructuredOutputManager
    from jaxkv.loader.converted import restore_params
    from jaxkv.loader.source import is_converted, load_checkpoint, load_tokenizer
    from jaxkv.models import cpu_linear
    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.models.params import dummy_params, params_from_tensors
    from jaxkv.runner import fused_greedy
    from jaxkv.runner.model_runner import ModelRunner

    from jaxkv.runner import multiprocess

    t0 = time.perf_counter()
    if multiprocess.wanted(args):  # before JAX starts its backends
        multiprocess.initialize(args)
    enable_compilation_cache()
    platform = jax.default_backend()
    ckpt = load_checkpoint(args.model, args.load_format)
    tokenizer = ckpt.tokenizer if args.tokenizer is None else load_tokenizer(args.tokenizer)
    if args.tokenizer is not None:
        logger.info("tokenizer: %s (not the model's own)", args.tokenizer)
    config = args.create_engine_config(platform=platform,
                                       model_config=ModelConfig.from_hf_config(ckpt.config),
                                       device_memory_bytes=device_memory_bytes(platform),
                                       num_processes=jax.process_count(),
                                       cpu_kernels_unavailable=cpu_kernels.unavailable)
    if jax.process_count() > 1:  # every process builds the leader's pool, runs its steps
        multiprocess.check_mesh(config.runner.tensor_parallel_size)
        config = multiprocess.share_config(config)
    log_attention_backend(config.runner.attention_backend)
    mesh = None
    if config.runner.tensor_parallel_size > 1:
        from jaxkv.models.sharding import make_mesh
        mesh = make_mesh(config.runner.tensor_parallel_size)
    mc, rc = config.model_config, config.runner
    cpu_matmul = cpu_matmul_wanted(rc, mesh)
    if cpu_matmul:
        logger.info("matmuls of at most %d rows (decode steps; the LM head of up to %d "
                    "sampled rows): C++ kernel (cpu backend)", cpu_linear.MAX_ROWS,
                    cpu_linear.MAX_ROWS_TRANSPOSED)
    model = LlamaModel(mc, dtype=jnp.dtype(rc.dtype),
                       attention=get_attention(rc.attention_backend, mesh), cpu_matmul=cpu_matmul)
    if fused_greedy.max_tokens(model):
        logger.info("greedy sampling fused into the step programs of token buckets <= %d",
                    fused_greedy.max_tokens(model))
    if args.load_format == "dummy":
        params = dummy_params(model, args.seed)
    elif is_converted(args.model):
        params = restore_params(args.model, model, mesh)
    else:
        params = params_from_tensors(model, ckpt.tensors)
    del ckpt.tensors
    logger.info("%s (%s)%s", config.cache.budget.log_line(), rc.kv_cache_dtype,
                f"; per device of tensor_parallel_size {rc.tensor_parallel_size}"
                if rc.tensor_parallel_size > 1 else "")

    cc = config.cache
    host, disk = kv_tiers(config, args)
    runner = ModelRunner(model, params, config, kv_disk_dir=disk.dir if disk else None)
    assert runner.offload is None or runner.offload.block_nbytes == cc.block_bytes, cc.block_bytes
    scheduler = Scheduler(KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                         host, disk),
                          config.scheduler, config.speculative,
                          StructuredOutputManager(tokenizer, mc.vocab_size, mc.eos_token_ids))
    if config.speculative is not None:
        logger.info("speculative decoding: %s", config.speculative.to_dict())
    logger.info("loaded %s (%s, %s, %.1f M params) in %.1f s", args.model or "SmolLM2-135M-Instruct",
                mc.architecture, rc.dtype,
                sum(x.size for x in jax.tree_util.tree_leaves(params)) / 1e6, time.perf_counter() - t0)
    if not rc.enforce_eager:
        secs, n = runner.warmup()
        rest = [t for t in rc.token_buckets if t not in rc.warmup_token_buckets]
        logger.info("warmup compiled %d programs in %.1f s (token buckets %s)%s", n, secs,
                    list(rc.warmup_token_buckets),
                    f"; token buckets {rest} compile in the background" if rest else "")
    if jax.process_index() > 0:  # a follower: never an engine of its own
        runner.start_background_compile()
        multiprocess.follow(runner)
        jax.distributed.shutdown()
        raise SystemExit(0)
    if jax.process_count() > 1:
        runner.leader = multiprocess.Leader()
    if rc.async_scheduling:
        logger.info("async scheduling: the next decode step is dispatched before this step's "
                    "tokens reach the host")
    engine = cls(config, tokenizer, scheduler, runner)
    compiler = runner.start_background_compile()
    if compiler is not None:  # a dropped engine stops its compiler (the thread holds the runner)
        weakref.finalize(engine, compiler.cancel)
    return engine
