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


def set_up_compilation() -> None:
    """The process's compile settings, before the weights load: the persistent cache on
    (enable_compilation_cache), and JAXKV_COMPILE_THREADS read, so that a bad value fails
    at once (ValueError naming it; jaxkv.runner.compiler.compile_workers)."""
    from jaxkv.runner.compiler import compile_workers
    enable_compilation_cache()
    compile_workers()


def log_attention_backend(backend: str) -> None:
    if backend == "cpu":
        from jaxkv import cpu_kernels
        info = cpu_kernels.build_info
        logger.info("attention backend: cpu (C++ ragged paged attention, %s in %.1f s)",
                    "loaded" if info.get("cached") else "compiled", info.get("seconds", 0.0))
    else:
        logger.info("attention backend: %s", backend)


def log_attention_variants(mc, backend: str) -> None:
    """A line for sliding windows and soft-capping, when the model has them."""
    windowed = [mc.window(i) for i in range(mc.num_layers) if mc.window(i)]
    parts = []
    if windowed:
        parts.append(f"sliding window {sorted(set(windowed))} on {len(windowed)} of "
                     f"{mc.num_layers} layers")
    if mc.attn_softcap or mc.final_softcap:
        parts.append(f"logit soft-capping (attention {mc.attn_softcap}, final {mc.final_softcap})")
    if parts:
        logger.info("attention: %s%s", "; ".join(parts), "; those layers take the XLA path on "
                    "the cpu backend" if backend == "cpu" and (windowed or mc.attn_softcap) else "")


def cpu_matmul_wanted(runner_config, mesh) -> bool:
    """Whether the model runs its few-row matmuls through jaxkv's C++ kernel
    (jaxkv/cpu_kernels/linear.py): with the (resolved) cpu attention backend, float32 weights
    and one device (a tensor-parallel mesh keeps XLA's partitioned dots)."""
    return (runner_config.attention_backend == "cpu" and runner_config.dtype == "float32"
            and mesh is None)


def fused_projections_wanted(runner_config, mesh) -> bool:
    """Whether each layer's q/k/v and gate/up weights are fused into one weight each
    (LlamaModel.fused_projections): on a GPU, with float weights on one device. There XLA would
    otherwise run three and two dots, each a launch (or, with its dot merger on, one Triton
    gemm fusion reading the weights apart, at half cuBLAS's bandwidth on 2026-12-04's H200:
    jaxkv/runner/xla_options.py); the CPU's C++ kernels already take them in one call."""
    import jax
    return jax.default_backend() == "gpu" and runner_config.quantization is None and mesh is None


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
                    "quantization": rc.quantization.name if rc.quantization else None,
                    "kv_cache_dtype": rc.kv_cache_dtype, "block_size": cc.block_size,
                    "num_layers": mc.num_layers, "num_kv_heads": mc.num_kv_heads,
                    "head_dim": mc.head_dim}
        disk = DiskTier(cc.kv_cache_disk_dir, cc.kv_cache_disk_bytes, cc.block_bytes, identity)
    logger.info("KV cache tiers: host %d blocks (%.2f GiB)%s", cc.num_host_blocks,
                cc.num_host_blocks * cc.block_bytes / 2**30,
                f", disk {disk.max_blocks} blocks ({disk.num_used} found) in {disk.dir}" if disk else "")
    return host, disk


def build_engine(cls, args):
    """EngineArgs -> a warmed-up engine of class `cls` (LLMEngine): the checkpoint and
    tokenizer, the EngineConfig (resolved once), the model and its params, the runner, the
    scheduler over the KV cache manager (and tiers), warmup, then the background compiler. A
    multi-process follower never returns: it serves the leader's steps, then exits."""
    import jax

    from jaxkv.loader.source import load_checkpoint, load_tokenizer
    from jaxkv.runner import multiprocess
    from jaxkv.runner.model_runner import ModelRunner

    t0 = time.perf_counter()
    if multiprocess.wanted(args):  # before JAX starts its backends
        multiprocess.initialize(args)
    set_up_compilation()
    ckpt = load_checkpoint(args.model, args.load_format, keep_quantized=args.quantization == "gguf",
                           with_tokenizer=args.tokenizer is None)
    tokenizer = ckpt.tokenizer if args.tokenizer is None else load_tokenizer(args.tokenizer)
    if args.tokenizer is not None:
        logger.info("tokenizer: %s (not the model's own)", args.tokenizer)
    config = resolve_config(args, ckpt.config)
    mesh = None
    if config.runner.tensor_parallel_size > 1:
        from jaxkv.models.sharding import make_mesh
        mesh = make_mesh(config.runner.tensor_parallel_size)
    model = build_model(config, mesh)
    params = load_params(args, model, ckpt, mesh)
    logger.info("%s (%s)%s", config.cache.budget.log_line(), config.runner.kv_cache_dtype,
                f"; per device of tensor_parallel_size {config.runner.tensor_parallel_size}"
                if config.runner.tensor_parallel_size > 1 else "")
    host, disk = kv_tiers(config, args)
    leader = multiprocess.Leader() if jax.process_count() > 1 and jax.process_index() == 0 else None
    runner = ModelRunner(model, params, config, kv_disk_dir=disk.dir if disk else None,
                         leader=leader)
    assert runner.offload is None or runner.offload.block_nbytes == config.cache.block_bytes
    scheduler = build_scheduler(config, tokenizer, host, disk)
    mc, quant = config.model_config, config.runner.quantization
    active = (f", {mc.num_params(active=True) / 1e6:.1f} M active: {mc.num_experts_per_tok} of "
              f"{mc.num_experts} experts" if mc.num_experts else "")
    logger.info("loaded %s (%s, %s, %.1f M params%s, weights %.2f GiB%s) in %.1f s",
                args.model or "SmolLM2-135M-Instruct", mc.architecture, config.runner.dtype,
                mc.num_params() / 1e6, active, runner.weights_bytes / 2**30,
                f" {quant.name}" + (" quantized at load" if quant.online else "") if quant else "",
                time.perf_counter() - t0)
    warm_up(runner, config.runner)
    if jax.process_index() > 0:  # a follower: never an engine of its own
        runner.start_background_compile()
        multiprocess.follow(runner)
        jax.distributed.shutdown()
        raise SystemExit(0)
    if leader is not None:  # this process has warmed up: its idle heartbeat may begin
        leader.start()
    if config.runner.async_scheduling:
        logger.info("async scheduling: the next decode step is dispatched before this step's "
                    "tokens reach the host")
    engine = cls(config, tokenizer, scheduler, runner)
    compiler = runner.start_background_compile()
    if compiler is not None:  # a dropped engine stops its compiler (the thread holds the runner)
        weakref.finalize(engine, compiler.cancel)
    return engine


def resolve_config(args, hf_config: dict):
    """The EngineConfig for this machine and job (a multi-process job takes the leader's)."""
    import jax

    from jaxkv import cpu_kernels
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.runner import multiprocess

    platform = jax.default_backend()
    if args.tensor_parallel_size > 1:  # the devices first: the backend's checks assume them
        from jaxkv.models.sharding import check_device_count
        check_device_count(args.tensor_parallel_size)
    config = args.create_engine_config(platform=platform,
                                       model_config=ModelConfig.from_hf_config(hf_config),
                                       device_memory_bytes=device_memory_bytes(platform),
                                       num_processes=jax.process_count(),
                                       cpu_kernels_unavailable=cpu_kernels.unavailable,
                                       quantization_config=hf_config.get("quantization_config"))
    if jax.process_count() > 1:  # every process builds the leader's pool, runs its steps
        multiprocess.check_mesh(config.runner.tensor_parallel_size)
        config = multiprocess.share_config(config)
    log_attention_backend(config.runner.attention_backend)
    return config


def build_model(config, mesh):
    """The Flax model of the config: its attention backend, and the C++ matmuls where wanted."""
    import jax.numpy as jnp

    from jaxkv.attention import get_attention
    from jaxkv.cpu_kernels import linear as cpu_linear
    from jaxkv.models.llama import LlamaModel
    from jaxkv.sampling import fused_sampling

    mc, rc = config.model_config, config.runner
    cpu_matmul = cpu_matmul_wanted(rc, mesh)
    if cpu_matmul and rc.quantization is None:
        logger.info("matmuls of at most %d rows (decode steps; the LM head of up to %d "
                    "sampled rows): C++ kernel (cpu backend)", cpu_linear.MAX_ROWS,
                    cpu_linear.MAX_ROWS_TRANSPOSED)
    elif cpu_matmul and rc.quantization.embedding_bits is None:
        logger.info("the float LM head's matmuls of at most %d rows: C++ kernel (cpu backend); "
                    "the %s layers dequantize in XLA", cpu_linear.MAX_ROWS, rc.quantization.name)
    elif cpu_matmul:  # gguf's tied LM head reads the embedding's blocks
        logger.info("matmuls: the %s layers and the LM head (the embedding's blocks) dequantize "
                    "in XLA", rc.quantization.name)
    log_attention_variants(mc, rc.attention_backend)
    fused = fused_projections_wanted(rc, mesh)
    if fused:
        logger.info("projections fused: q/k/v and gate/up as one weight each (one matmul each)")
    if rc.scan_layers:
        logger.info("decoder layers scanned: one loop over %d layers' stacked weights", mc.num_layers)
    model = LlamaModel(mc, dtype=jnp.dtype(rc.dtype),
                       attention=get_attention(rc.attention_backend, mesh), cpu_matmul=cpu_matmul,
                       quant=rc.quantization, fused_projections=fused, scan_layers=rc.scan_layers)
    if fused_sampling.max_tokens(rc.tensor_parallel_size):
        logger.info("sampling fused into the step programs (plain steps: no logprobs, "
                    "penalties, logits filters, grammar or drafts)")
    return model


def load_params(args, model, ckpt, mesh):
    """The model's params: random (load_format="dummy"), restored from a converted folder, or
    made from the checkpoint's tensors (which are dropped afterwards)."""
    from jaxkv.loader.converted import restore_params
    from jaxkv.loader.source import is_converted
    from jaxkv.models.params import dummy_params, params_from_tensors

    if args.load_format == "dummy":
        params = dummy_params(model, args.seed)
    elif is_converted(args.model) and model.quant is not None:
        raise ValueError("quantization: a folder written by `jaxkv convert` holds float weights; "
                         "load the checkpoint itself to quantize it")
    elif is_converted(args.model):
        params = restore_params(args.model, model, mesh)
    else:
        params = params_from_tensors(model, ckpt.tensors)
    del ckpt.tensors
    return params


def build_scheduler(config, tokenizer, host, disk):
    """The Scheduler over a KV cache manager of the config's pool (and tiers), with the
    structured-output manager of this tokenizer."""
    from jaxkv.core.kv_cache_manager import KVCacheManager
    from jaxkv.core.scheduler import Scheduler
    from jaxkv.core.grammar import StructuredOutputManager

    cc, mc = config.cache, config.model_config
    if config.speculative is not None:
        logger.info("speculative decoding: %s", config.speculative.to_dict())
    window = mc.kv_sliding_window
    if window is not None:
        logger.info("every layer has a sliding window: KV blocks behind the last %d tokens of "
                    "a sequence are freed as it advances", window)
    return Scheduler(KVCacheManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                    host, disk, sliding_window=window),
                     config.scheduler, config.speculative,
                     StructuredOutputManager(tokenizer, mc.vocab_size, mc.eos_token_ids))


def warm_up(runner, rc) -> None:
    """Compile the warmup token buckets' programs (none with enforce_eager)."""
    if rc.enforce_eager:
        return
    secs, n = runner.warmup()
    rest = [t for t in rc.token_buckets if t not in rc.warmup_token_buckets]
    logger.info("warmup compiled %d programs in %.1f s on %d threads (token buckets %s)%s", n,
                secs, runner.compile_workers, list(rc.warmup_token_buckets),
                f"; token buckets {rest} compile in the background" if rest else "")
