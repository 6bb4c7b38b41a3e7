"""`jaxkv generate | plan | serve`. Engine flags are spelled as vLLM's.

Bad flags give a one-line error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxkv.core.kv_budget import parse_bytes


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The EngineArgs flags, with vLLM's spelling."""
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face model folder "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="KV cache budget in bytes; also accepts 1GiB, 512MiB")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "xla"])
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)


ENGINE_FLAGS = ("model", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                "kv_cache_memory_bytes", "num_gpu_blocks_override", "gpu_memory_utilization",
                "enable_prefix_caching", "enforce_eager", "dtype", "load_format",
                "attention_backend", "max_logprobs", "seed")


def engine_args_from(ns):
    from jaxkv.config import EngineArgs
    return EngineArgs(**{k: getattr(ns, k) for k in ENGINE_FLAGS})


def cmd_generate(ns) -> int:
    import time

    from jaxkv.llm import LLM
    from jaxkv.sampling_params import SamplingParams

    # Unseeded requests draw their seed from the engine's --seed, so runs are reproducible.
    sp = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p)
    llm = LLM.from_engine_args(engine_args_from(ns))
    tok = llm.get_tokenizer()
    t0 = time.perf_counter()
    if ns.no_chat or not getattr(tok, "chat_template", None):
        out = llm.generate(ns.prompt, sp, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": ns.prompt}], sp, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    c = out.outputs[0]
    print(c.text)
    print(f"[{len(c.token_ids)} tokens in {dt:.2f} s, {len(c.token_ids) / dt:.1f} tokens/s, "
          f"finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0


def cmd_plan(ns) -> int:
    import jax

    # The engine's own resolver, for this machine's platform: what `serve` would allocate.
    platform = jax.default_backend()
    from jaxkv.engine.setup import device_memory_bytes
    config = engine_args_from(ns).create_engine_config(platform=platform,
                                                       device_memory_bytes=device_memory_bytes(platform))
    mc, b, dtype = config.model_config, config.cache.budget, config.runner.dtype
    if ns.json:
        print(json.dumps({"bytes_per_token": b.bytes_per_token, "num_blocks": b.num_blocks,
                          "num_tokens": b.num_tokens, "max_concurrency": round(b.max_concurrency, 4)}))
    else:
        from jaxkv.engine_config import DTYPE_BYTES
        print(f"model: {ns.model or 'SmolLM2-135M-Instruct (embedded)'} ({mc.num_layers} layers, "
              f"{mc.num_kv_heads} KV heads x {mc.head_dim}, {dtype} on {platform})")
        print(f"bytes per token: {b.bytes_per_token:,}  (2 x {mc.num_layers} x {mc.num_kv_heads} x "
              f"{mc.head_dim} x {DTYPE_BYTES[dtype]})")
        print(f"blocks: {b.num_blocks:,} of {b.block_size} tokens = {b.num_tokens:,} tokens")
        print(f"max concurrency at {config.max_model_len:,} tokens per request: {b.max_concurrency:.2f}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"jaxkv: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxkv", description="LLM serving engine in JAX")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_engine_flags(g)
    g.set_defaults(func=cmd_generate)
    pl = sub.add_parser("plan", help="KV cache arithmetic for a model, without loading weights")
    add_engine_flags(pl)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)
    from serve.server import add_serve_parser
    add_serve_parser(sub)
    return p


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
