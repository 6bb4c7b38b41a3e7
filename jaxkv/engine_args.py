"""EngineArgs: every engine knob, with vLLM's names, validated once where it enters.

Nothing below the engine reads the CLI or the environment. EngineArgs only validates what it
is given and never rewrites it; `create_engine_config` resolves the defaults (for the platform
and the model) into a frozen EngineConfig that the scheduler, runner and engine read.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import types
import typing
from dataclasses import dataclass, field

from jaxkv.core.kv_budget import parse_bytes
from jaxkv.core.spec_decode import SpeculativeConfig
from jaxkv.engine_config import ATTENTION_BACKENDS, check_batched_tokens, create_engine_config
from jaxkv.quantization import QUANTIZATIONS
from jaxkv.structured_outputs.params import StructuredOutputsConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's --kv-cache-dtype values jaxkv implements ("fp8" is fp8_e4m3, as in vLLM), plus int8;
# the one-byte ones carry a scale per token and KV head (jaxkv/attention/kv_pool.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
PREEMPTION_MODES = ("recompute", "swap")
MAX_SCHEDULER_STEPS = 64  # num_scheduler_steps (multi-step decode)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


def _positive_int(x) -> bool:
    try:
        return not isinstance(x, bool) and operator.index(x) >= 1
    except TypeError:
        return False


def _arg(default, help: str, **cli):
    """A field with its CLI help (and argparse extras: choices, type, metavar)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """Engine arguments (names and meanings as vLLM's EngineArgs). Each field's metadata holds
    its CLI help, so `add_cli_args` gives `jaxkv generate`, `plan` and `serve` every field as
    `--field-name` (booleans also as `--no-field-name`) from this one declaration."""
    model: str | None = _arg(None, "a .gguf file or a Hugging Face model folder (config.json + "
                             "*.safetensors + tokenizer files); default: the embedded "
                             "SmolLM2-135M-Instruct GGUF")
    tokenizer: str | None = _arg(None, "a tokenizer folder (Hugging Face files) or a .gguf file to "
                                 "use instead of the model's own tokenizer")
    trust_remote_code: bool = _arg(False, "accepted for vLLM compatibility; jaxkv never runs code "
                                   "from a checkpoint (its models are its own), so it changes nothing")
    dtype: str = _arg("auto", "weights and KV dtype; auto = bfloat16 on a GPU, float32 elsewhere",
                      choices=DTYPES)
    quantization: str | None = _arg(
        None, "the decoder layers' weights quantized (vLLM's names): fp8 (float8 weights; a float "
        "checkpoint is quantized at load), awq or gptq (4-bit checkpoints), compressed-tensors "
        "(llm-compressor's fp8), gguf (a GGUF file's Q8_0/Q4_0/Q4_1 blocks kept as they are); "
        "default: the checkpoint's quantization_config (a GGUF file: float), else float",
        choices=QUANTIZATIONS)
    kv_cache_dtype: str = _arg("auto", "dtype of the KV pool: auto = the model's dtype; bfloat16 "
                               "or float16 hold 2x the tokens of float32; int8, fp8 (= fp8_e4m3) "
                               "and fp8_e5m2 3.9x (one byte per value plus a bfloat16 scale per "
                               "token and KV head)",
                               choices=KV_CACHE_DTYPES)
    block_size: int = _arg(16, "tokens per KV block (a power of two)")
    max_model_len: int | None = _arg(None, "prompt + output tokens of one request; default: the "
                                     "model's max_position_embeddings")
    max_num_seqs: int = _arg(64, "most sequences in one step")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one step; default: 512 on a "
                                              "CPU, 8192 on a GPU")
    kv_cache_memory_bytes: int | str | None = _arg(
        None, "KV cache budget in bytes; also accepts 1GiB, 512MiB (precedence: "
        "num_gpu_blocks_override, then this, then gpu_memory_utilization on a GPU; 1 GiB on a CPU)",
        type=parse_bytes)
    num_gpu_blocks_override: int | None = _arg(None, "number of KV blocks, overriding the budget")
    gpu_memory_utilization: float = _arg(0.9, "share of GPU memory for weights + KV cache")
    enable_prefix_caching: bool = _arg(True, "share full KV blocks between requests by hash")
    enable_chunked_prefill: bool | None = _arg(None, "split long prompts over steps under the token "
                                        "budget; always on in jaxkv (--no-enable-chunked-prefill "
                                        "is refused)")
    enforce_eager: bool = _arg(False, "run without jit (debugging; very slow)")
    async_scheduling: bool | None = _arg(
        None, "dispatch the next decode step before this step's sampled tokens reach the host, "
        "so scheduling, detokenizing and stop checks overlap the device; default: on where "
        "supported (one process without tensor parallelism), as vLLM (see "
        "docs/async-scheduling.md)")
    num_scheduler_steps: int = _arg(
        1, "decode steps per engine step: k > 1 runs up to k steps of a batch of plain decodes "
        "(no logprobs, penalties, logits filters or grammar) in one program, fed back on the "
        "device, as vLLM V0's multi-step scheduling (docs/async-scheduling.md#multi-step-decode)")
    scan_layers: bool = _arg(
        False, "run the decoder layers as one loop over their stacked weights instead of "
        "unrolled: a step program that compiles one layer, not all, with ~10 weight arguments "
        "instead of ~6 a layer; to measure on a GPU (docs/performance.md); refused where the "
        "layers differ (sliding-window patterns, MoE), for quantized weights, with tensor "
        "parallelism and with the cpu attention backend (auto's choice on a CPU: use xla)")
    load_format: str = _arg("auto", "how to read the model", choices=LOAD_FORMATS)
    attention_backend: str = _arg("auto", "auto = pallas on a GPU, cpu on a CPU (ragged paged "
                                  "attention in C++, built on first use with g++; xla, pure "
                                  "JAX, when it cannot be built), xla on other platforms",
                                  choices=ATTENTION_BACKENDS)
    max_logprobs: int = _arg(20, "most logprobs a request may ask for")
    seed: int = _arg(0, "engine seed: unseeded requests draw their seeds from it")
    swap_space: float = _arg(0, "GiB of host memory for the KV cache's host tier: full blocks "
                             "evicted from the device pool (and swapped-out requests' blocks) "
                             "are kept there by hash and loaded back on a prefix hit (0: none)")
    kv_offloading_size: float | None = _arg(None, "the host tier's size in GiB, as vLLM V1 spells "
                                            "it (the same pool as --swap-space)")
    preemption_mode: str = _arg("recompute", "what a preempted request's blocks become: recompute "
                                "(freed; computed again) or swap (copied to the host tier and "
                                "loaded back when it resumes)", choices=PREEMPTION_MODES)
    kv_cache_disk_dir: str | None = _arg(None, "folder of the KV cache's disk tier: every block the "
                                         "host tier takes is also written there and read back on "
                                         "a prefix hit, across restarts (one subfolder per model "
                                         "identity)")
    kv_cache_disk_bytes: int | str | None = _arg(None, "the disk tier's size in bytes (also 20GiB, "
                                                 "500MiB)", type=parse_bytes)
    tensor_parallel_size: int = _arg(1, "devices the model is split over (tensor parallelism on "
                                     "a JAX mesh: heads and MLP columns per device, the KV pool by "
                                     "KV head)")
    enable_expert_parallel: bool = _arg(False, "a mixture of experts places whole experts on "
                                        "each device of the tensor-parallel mesh (num_experts / "
                                        "tensor_parallel_size each) instead of splitting every "
                                        "expert's columns")
    distributed_coordinator: str | None = _arg(
        None, "HOST:PORT of process 0's jax.distributed coordinator, for one engine over the "
        "devices of several processes or hosts (none: JAX's environment, "
        "JAX_COORDINATOR_ADDRESS or a SLURM / Open MPI / Kubernetes job)", metavar="HOST:PORT")
    num_processes: int | None = _arg(None, "processes of a multi-process engine; process 0 runs "
                                     "the scheduler and the server, the others its steps")
    process_id: int | None = _arg(None, "this process's index in a multi-process engine "
                                  "(0 .. num_processes - 1)")
    distributed_timeout: float = _arg(300.0, "seconds a process of a multi-process engine waits "
                                      "for the coordinator and the other processes")
    token_buckets: tuple[int, ...] | None = _arg(
        None, "padded token counts of a step, e.g. 8,64,256 (default: powers of 2 below "
        "max_num_batched_tokens, then the budget)", type=_int_list, metavar="N,N,...")
    speculative_config: dict | str | None = _arg(
        None, "speculative decoding as a JSON object, vLLM's names: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 7, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} "
        "(n-gram prompt lookup; optional \"disable_by_batch_size\": N; off when not given)", type=str, metavar="JSON")
    structured_outputs_config: dict | str | None = _arg(
        None, "structured outputs as a JSON object, vLLM's names: {\"backend\": \"guidance\", "
        "\"disable_any_whitespace\": false, \"disable_additional_properties\": false} (llguidance "
        "is the backend; the flags are defaults for every request)", type=str, metavar="JSON")
    warmup_token_buckets: tuple[int, ...] | None = _arg(
        None, "the token buckets compiled before the engine is ready; the others compile in a "
        "background thread and steps use them once compiled (default: powers of 8 below "
        "max_num_batched_tokens, then the budget; all of --token-buckets when those are given)",
        type=_int_list, metavar="N,N,...")

    def __post_init__(self):
        def bad(name, rule):
            raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        def pos_int(name, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be a positive integer")

        self._check_dtypes(bad)
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
        if self.enable_chunked_prefill is False:
            bad("enable_chunked_prefill", "cannot be turned off: jaxkv's scheduler always chunks "
                "prompts under max_num_batched_tokens (as vLLM V1)")
        self._check_tiers(bad)
        pos_int("tensor_parallel_size")
        self._check_distributed(bad, pos_int)
        self._check_scheduling(bad, pos_int)
        for name in ("token_buckets", "warmup_token_buckets"):
            v = getattr(self, name)
            if v is not None and (not v or not all(_positive_int(x) for x in v)):
                bad(name, "must be a non-empty list of positive integers")
        if SpeculativeConfig.from_value(self.speculative_config) and self.async_scheduling:
            bad("async_scheduling", "is not supported with speculative decoding (n-gram drafts "
                "are proposed from the tokens on the host) yet")
        StructuredOutputsConfig.from_value(self.structured_outputs_config)
        if self.token_buckets and self.warmup_token_buckets:
            stray = sorted(set(self.warmup_token_buckets) - set(self.token_buckets))
            if stray:
                bad("warmup_token_buckets", f"must be among token_buckets {tuple(self.token_buckets)} "
                    f"({stray[0]} is not)")

    def host_tier_bytes(self) -> int:
        """Bytes of the host tier (swap_space or kv_offloading_size, in GiB)."""
        gib = self.kv_offloading_size if self.kv_offloading_size is not None else self.swap_space
        return int(gib * (1 << 30))

    def _check_dtypes(self, bad) -> None:
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            bad("quantization", f"must be one of {QUANTIZATIONS} or None")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")

    def _check_tiers(self, bad) -> None:
        for name in ("swap_space", "kv_offloading_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                bad(name, "must be a finite number of GiB >= 0")
        if self.kv_offloading_size is not None and self.swap_space and self.swap_space != self.kv_offloading_size:
            bad("kv_offloading_size", f"and swap_space ({self.swap_space}) name the same host tier: "
                "give one of them")
        if self.preemption_mode not in PREEMPTION_MODES:
            bad("preemption_mode", f"must be one of {PREEMPTION_MODES}")
        host = self.host_tier_bytes()
        if self.preemption_mode == "swap" and not host:
            bad("preemption_mode", "swap needs a host tier to swap to: set swap_space (GiB) > 0")
        if host and not self.enable_prefix_caching:
            bad("swap_space", "needs enable_prefix_caching: the host tier keeps blocks by their hash")
        if host and (self.num_processes or 1) > 1:
            bad("swap_space", "is not supported by a multi-process engine (num_processes > 1) yet")
        if self.kv_cache_disk_bytes is not None and parse_bytes(self.kv_cache_disk_bytes) <= 0:
            bad("kv_cache_disk_bytes", "must be positive")
        if (self.kv_cache_disk_dir is None) != (self.kv_cache_disk_bytes is None):
            bad("kv_cache_disk_dir" if self.kv_cache_disk_dir is None else "kv_cache_disk_bytes",
                "must be given with " + ("kv_cache_disk_bytes" if self.kv_cache_disk_dir is None
                                         else "kv_cache_disk_dir"))
        if self.kv_cache_disk_dir is not None and not host:
            bad("kv_cache_disk_dir", "needs a host tier in front of it: set swap_space (GiB) > 0")

    def _check_scheduling(self, bad, pos_int) -> None:
        """async_scheduling and num_scheduler_steps: their values, and what they need (one
        process without tensor parallelism; multi-step decode also no speculative decoding)."""
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            bad("async_scheduling", "must be true, false or None (auto)")
        one_device = self.tensor_parallel_size == 1 and (self.num_processes or 1) == 1
        if self.async_scheduling and not one_device:
            bad("async_scheduling", "is not supported with tensor_parallel_size > 1 or "
                "num_processes > 1 yet")
        pos_int("num_scheduler_steps")
        if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
            bad("num_scheduler_steps", f"must be at most {MAX_SCHEDULER_STEPS} (each step's "
                "program loops that often, and each sequence holds that many slots ahead)")
        if self.num_scheduler_steps > 1 and (not one_device or SpeculativeConfig.from_value(self.speculative_config)):
            bad("num_scheduler_steps", "above 1 is not supported with tensor_parallel_size > 1, "
                "num_processes > 1 or speculative decoding yet")

    def _check_distributed(self, bad, pos_int) -> None:
        pos_int("num_processes", True)
        if self.process_id is not None:
            if isinstance(self.process_id, bool) or not isinstance(self.process_id, int) or self.process_id < 0:
                bad("process_id", "must be an integer >= 0")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                bad("process_id", f"must be less than num_processes ({self.num_processes})")
        c = self.distributed_coordinator
        if c is not None:
            host, _, port = str(c).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                bad("distributed_coordinator", "must be HOST:PORT (a port in 1..65535)")
        if isinstance(self.distributed_timeout, bool) or not isinstance(self.distributed_timeout, (int, float)) \
                or not self.distributed_timeout > 0:
            bad("distributed_timeout", "must be a positive number of seconds")
        if self.enforce_eager and (self.num_processes or 1) > 1:
            bad("enforce_eager", "cannot run a multi-process engine (num_processes > 1): its "
                "processes run the same compiled programs")

    def create_engine_config(self, *, platform: str, **machine):
        """Every value resolved once, frozen: jaxkv.engine_config.create_engine_config, whose
        keyword arguments (model_config, device_memory_bytes, num_processes,
        cpu_kernels_unavailable) `machine` passes on."""
        return create_engine_config(self, platform=platform, **machine)

    # ---- the command line (vLLM's add_cli_args / from_cli_args) -----------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one flag per field: --field-name (type, default, choices and help from the
        field); booleans as --field-name / --no-field-name."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            flag = "--" + f.name.replace("_", "-")
            help_ = f"{meta.pop('help')} (default: {f.default})"
            if _scalar_type(hints[f.name]) is bool:  # bool or bool | None
                parser.add_argument(flag, dest=f.name, default=f.default, help=help_,
                                    action=argparse.BooleanOptionalAction)
                continue
            meta.setdefault("type", _scalar_type(hints[f.name]))
            parser.add_argument(flag, dest=f.name, default=f.default, help=help_, **meta)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """EngineArgs from a namespace parsed with add_cli_args (ValueError on bad values)."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _scalar_type(hint):
    """int | None -> int; str | None -> str; float -> float."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(
        hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    return args[0]
