"""`jaxkv generate | plan | serve`. Engine flags are spelled as vLLM's and generated from the
EngineArgs fields (EngineArgs.add_cli_args), so a new engine argument reaches every command by
being declared once. `serve` comes from the serve package through the entry-point group
"jaxkv.commands": jaxkv never imports the server.

Bad flags give a one-line error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from importlib.metadata import entry_points

from jaxkv.engine_args import EngineArgs

# Subcommands that live above the engine (the HTTP server) register here as entry points
# (pyproject.toml), so jaxkv itself never imports them: name -> "module:add_parser(subparsers)".
COMMAND_GROUP = "jaxkv.commands"


def engine_args_from(ns) -> EngineArgs:
    return EngineArgs.from_cli_args(ns)


def cmd_generate(ns) -> int:
    import time

    from jaxkv.llm import LLM
    from jaxkv.sampling.params import SamplingParams

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
    st = llm.stats()
    spec = ""
    if st.spec_decode_num_drafts:
        spec = (f", draft acceptance rate {st.spec_decode_acceptance_rate:.2f}, mean acceptance "
                f"length {1 + st.spec_decode_num_accepted_tokens / st.spec_decode_num_drafts:.2f}")
    print(f"[{len(c.token_ids)} tokens in {dt:.2f} s, {len(c.token_ids) / dt:.1f} tokens/s, "
          f"finish_reason={c.finish_reason}{spec}]", file=sys.stderr)
    return 0


def cmd_plan(ns) -> int:
    import jax

    # The engine's own resolver, for this machine's platform: what `serve` would allocate.
    platform = jax.default_backend()
    from jaxkv.engine.setup import device_memory_bytes
    config = engine_args_from(ns).create_engine_config(platform=platform,
                                                       device_memory_bytes=device_memory_bytes(platform))
    mc, b, dtype = config.model_config, config.cache.budget, config.runner.dtype
    kv_dtype = config.runner.kv_cache_dtype
    from jaxkv.engine_config import DTYPE_BYTES, kv_tier_capacities
    from jaxkv.quantization import weights_bytes
    tiers = kv_tier_capacities(config)
    quant = config.runner.quantization
    weights = weights_bytes(mc, DTYPE_BYTES[dtype], quant)
    if ns.json:
        moe = ({"num_params": mc.num_params(), "num_active_params": mc.num_params(active=True)}
               if mc.num_experts else {})
        print(json.dumps({"quantization": quant.name if quant else None, "weights_bytes": weights, **moe,
                          "bytes_per_token": b.bytes_per_token, "num_blocks": b.num_blocks,
                          "num_tokens": b.num_tokens, "max_concurrency": round(b.max_concurrency, 4),
                          **({"kv_tiers": tiers} if tiers else {})}))
    else:
        from jaxkv.engine_config import KV_SCALE_BYTES, kv_heads_per_device
        print(f"model: {ns.model or 'SmolLM2-135M-Instruct (embedded)'} ({mc.num_layers} layers, "
              f"{mc.num_kv_heads} KV heads x {mc.head_dim}, {dtype} on {platform})")
        if mc.num_experts:
            print(f"experts: {mc.num_experts} per MoE layer ({len(mc.moe_layers)} of "
                  f"{mc.num_layers} layers), {mc.num_experts_per_tok} per token: "
                  f"{mc.num_params(active=True) / 1e6:.1f} M of the params active per token")
        print(f"weights: {weights / 2**30:.2f} GiB ({mc.num_params() / 1e6:.1f} M params, "
              + (f"decoder layers {quant.name}" + (" quantized at load" if quant.online else "")
                 if quant else dtype) + ")")
        per_head = f"{mc.head_dim} x {DTYPE_BYTES[kv_dtype]}"
        if kv_dtype in KV_SCALE_BYTES:  # one scale per token and KV head
            per_head = f"({per_head} + {KV_SCALE_BYTES[kv_dtype]} scale)"
        tp = config.runner.tensor_parallel_size
        print(f"bytes per token: {b.bytes_per_token:,}  (2 x {mc.num_layers} x "
              f"{kv_heads_per_device(mc, tp)} x "
              f"{per_head}: KV cache {kv_dtype}" + (f", per device of {tp}" if tp > 1 else "") + ")")
        print(f"blocks: {b.num_blocks:,} of {b.block_size} tokens = {b.num_tokens:,} tokens")
        print(f"max concurrency at {config.max_model_len:,} tokens per request: {b.max_concurrency:.2f}")
        for name, t in tiers.items():
            per = config.cache.block_bytes + (8 if name == "disk" else 0)  # a file's CRC trailer
            print(f"{name} tier: {t['blocks']:,} blocks = {t['tokens']:,} tokens = {t['requests']:.2f} "
                  f"requests of {config.max_model_len:,} tokens ({per:,} bytes per block)")
    return 0


def cmd_convert(ns) -> int:
    """Convert once, then time a load of the result (what every later start pays) next to it."""
    import time

    import jax
    import jax.numpy as jnp

    from jaxkv.loader.converted import convert, restore_params
    from jaxkv.loader.source import read_config
    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    secs = convert(ns.model, ns.out_dir)
    print(f"converted {ns.model or 'SmolLM2-135M-Instruct (embedded)'} to {ns.out_dir} in {secs:.1f} s")
    t0 = time.perf_counter()
    model = LlamaModel(ModelConfig.from_hf_config(read_config(ns.out_dir)), dtype=jnp.float32)
    params = restore_params(ns.out_dir, model)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"loading it takes {time.perf_counter() - t0:.1f} s ({n / 1e6:.1f} M params); "
          f"use it as: jaxkv serve {ns.out_dir}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"jaxkv: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxkv", description="LLM serving engine in JAX")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=cmd_generate)
    pl = sub.add_parser("plan", help="KV cache arithmetic for a model, without loading weights")
    EngineArgs.add_cli_args(pl)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)
    cv = sub.add_parser("convert", help="convert a model (GGUF or HF folder) to jaxkv params in an "
                        "orbax checkpoint, which later starts load without converting")
    cv.add_argument("model", nargs="?", default=None, metavar="MODEL",
                    help="a .gguf file or a Hugging Face model folder (default: the embedded model)")
    cv.add_argument("out_dir", metavar="OUT_DIR", help="a new (or empty) folder")
    cv.set_defaults(func=cmd_convert)
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        ep.load()(sub)  # e.g. `serve` from the serve package
    return p


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
