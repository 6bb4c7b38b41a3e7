"""Tensor-parallel runs in a process of their own (forced host devices must be set before JAX
starts): `python -m tests.runner.tp_check CASE` prints one JSON line for
tests/runner/test_tensor_parallel.py.

tiny: a random-weight Llama (4 query / 2 KV heads) at TP 1, 2 (KV heads split) and 4 (KV
heads replicated), and the Pallas kernels per shard at TP 2: greedy tokens with top-2 margins,
shardings and bytes per device. smollm2: the embedded model at TP 1 and 3 (9 / 3 heads).
errors: the one-line errors. converted: a `jaxkv convert` folder restored under TP 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=True)
ENGINE = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8, token_buckets=(8, 32),
              kv_cache_memory_bytes=1 << 20, seed=0)


def tiny_folder(config: dict = TINY) -> str:
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(d)
    return d


def run(llm, prompts, max_tokens):
    from jaxkv import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[{str(t): lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs]
                         for o in outs]}


def layout(llm) -> dict:
    from jaxkv.models.sharding import bytes_per_device
    r = llm.llm_engine.runner
    spec = lambda x: str(getattr(x.sharding, "spec", "single"))  # noqa: E731
    return {"q_proj": spec(r.params["layers_0"]["q_proj"]["kernel"]),
            "o_proj": spec(r.params["layers_0"]["o_proj"]["kernel"]),
            "embed": spec(r.params["embed_tokens"]["embedding"]),
            "pool": spec(r.kv_cache.k), "pool_bytes": bytes_per_device(r.kv_cache),
            "param_bytes": bytes_per_device(r.params), "num_blocks": r.num_blocks}


def main(case: str) -> dict:
    from jaxkv import LLM
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 5 * i))} for i in range(5)]
    if case == "tiny":
        d, out = tiny_folder(), {}
        for backend, tp in (("xla", 1), ("xla", 2), ("xla", 4), ("pallas", 2)):
            llm = LLM(model=d, load_format="dummy", tensor_parallel_size=tp,
                      attention_backend=backend, **ENGINE)
            n0 = llm.stats().num_compilations
            out[f"{backend}{tp}"] = {**run(llm, prompts, 10), **layout(llm)}
            if backend == "xla":  # greedy and random rows, after warmup: nothing compiles
                from jaxkv import SamplingParams
                llm.generate(prompts, [SamplingParams(temperature=t, seed=1, max_tokens=4)
                                       for t in (0.0, 0.8, 0.8, 0.0, 1.0)], use_tqdm=False)
                llm.generate(prompts, SamplingParams(temperature=0.8, top_k=5, max_tokens=3),
                             use_tqdm=False)
                out[f"{backend}{tp}"]["compiled_after_warmup"] = llm.stats().num_compilations - n0
            llm.llm_engine.shutdown()
        return out
    if case == "smollm2":
        out = {}
        for tp in (1, 3):
            llm = LLM(tensor_parallel_size=tp, **dict(ENGINE, max_model_len=256,
                                                      kv_cache_memory_bytes=8 << 20))
            out[str(tp)] = {**run(llm, prompts[:3], 8), **layout(llm)}
            llm.llm_engine.shutdown()
        return out
    if case == "errors":
        d, out = tiny_folder(), {}
        for name, kw in (("heads", dict(tensor_parallel_size=3)),
                         ("pallas_replicated", dict(tensor_parallel_size=4, attention_backend="pallas"))):
            try:
                LLM(model=d, load_format="dummy", **{**ENGINE, **kw})
                out[name] = None
            except ValueError as e:
                out[name] = str(e)
        from jaxkv.models.sharding import make_mesh
        try:
            make_mesh(8)
            out["devices"] = None
        except ValueError as e:
            out["devices"] = str(e)
        return out
    if case == "converted":
        from jaxkv.loader.converted import convert
        d = os.path.join(tempfile.mkdtemp(), "conv")
        convert(tiny_folder_with_weights(), d)
        a = LLM(model=d, tensor_parallel_size=2, **ENGINE)
        b = LLM(model=d, **ENGINE)
        return {"tp2": {**run(a, prompts, 6), **layout(a)}, "tp1": run(b, prompts, 6)}
    if case == "quantized":
        return quantized(prompts)
    if case == "moe":
        return moe(prompts)
    if case == "moe_quantized":
        return moe_quantized(prompts)
    if case == "windowed":
        return windowed(prompts)
    raise SystemExit(f"unknown case {case!r}")


def quantized(prompts) -> dict:
    """fp8 (a float folder quantized at load) and AWQ int4 (a folder written in AutoAWQ's
    layout) at TP 1 and 2: tokens and where the quantized leaves live."""
    import pathlib

    from jaxkv import LLM
    from jaxkv.models.sharding import bytes_per_device
    from tests.models.test_architectures import COMMON
    from tests.models.test_quantized_checkpoints import _write
    awq = pathlib.Path(tempfile.mkdtemp())
    _write("awq", awq, {**COMMON, "intermediate_size": 128})  # 4 groups of 32: 2 per device
    out = {}
    for name, folder, kw in (("fp8", tiny_folder_with_weights(), dict(quantization="fp8")),
                             ("awq", str(awq), {})):
        for tp in (1, 2):
            llm = LLM(model=folder, tensor_parallel_size=tp, **ENGINE, **kw)
            p = llm.llm_engine.runner.params["layers_0"]
            spec = lambda x: str(getattr(x.sharding, "spec", "single"))  # noqa: E731
            out[f"{name}{tp}"] = {**run(llm, prompts, 8), "quantization": llm.stats().quantization,
                                  "leaves": {f"{m}.{k}": spec(v) for m in ("q_proj", "o_proj")
                                             for k, v in p[m].items()},
                                  "param_bytes": bytes_per_device(llm.llm_engine.runner.params)}
            llm.llm_engine.shutdown()
    return out


def moe(prompts) -> dict:
    """Mixtral and Qwen2-MoE (a shared expert) at TP 1 and 2, and at TP 2 with expert
    parallelism: tokens and the experts' split."""
    import pathlib

    from jaxkv import LLM
    from tests.models.test_moe import make_moe
    out = {}
    for name in ("mixtral", "qwen2_moe"):
        d = pathlib.Path(tempfile.mkdtemp())
        make_moe(name, d)
        for tp, ep in ((1, False), (2, False), (2, True)):
            llm = LLM(model=str(d), tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE)
            mlp = llm.llm_engine.runner.params["layers_0"]["mlp"]
            spec = lambda x: str(getattr(x.sharding, "spec", "single"))  # noqa: E731
            out[f"{name}{tp}{'ep' if ep else ''}"] = {**run(llm, prompts, 8), "gate_proj": spec(mlp["gate_proj"]),
                                  "down_proj": spec(mlp["down_proj"]), "router": spec(mlp["router"])}
            llm.llm_engine.shutdown()
    return out


def moe_quantized(prompts) -> dict:
    """A Qwen2-MoE (experts of 64: two groups of 32) with fp8 weights (quantized at load) and
    in AutoAWQ's int4 layout, at TP 1, 2 and 2 with expert parallelism: tokens and where the
    experts' quantized leaves live."""
    import pathlib

    from jaxkv import LLM
    from tests.models.test_quantized_checkpoints import _write_moe
    d = pathlib.Path(tempfile.mkdtemp())
    _write_moe("awq", d, moe_intermediate_size=64)
    out = {}
    for name, folder, kw in (("fp8", str(d / "float"), dict(quantization="fp8")), ("awq", str(d), {})):
        for tp, ep in ((1, False), (2, False), (2, True)):
            llm = LLM(model=folder, tensor_parallel_size=tp, enable_expert_parallel=ep, **ENGINE, **kw)
            mlp = llm.llm_engine.runner.params["layers_0"]["mlp"]
            spec = lambda x: str(getattr(x.sharding, "spec", "single"))  # noqa: E731
            out[f"{name}{tp}{'ep' if ep else ''}"] = {
                **run(llm, prompts, 8), "quantization": llm.stats().quantization,
                "leaves": {f"{m}.{k}": spec(v) for m in ("gate_proj", "down_proj")
                           for k, v in mlp[m].items()}}
            llm.llm_engine.shutdown()
    return out


def windowed(prompts) -> dict:
    """Mistral (every layer windowed), Gemma 2 and Gemma 3 (local and global layers,
    soft-capping) at TP 1 and 2, with windows shorter than the prompts."""
    import pathlib

    from jaxkv import LLM
    from tests.models.test_sliding_window_models import make_windowed
    out = {}
    for name in ("mistral", "gemma2", "gemma3"):
        d = pathlib.Path(tempfile.mkdtemp())
        make_windowed(name, d)
        for tp in (1, 2):
            llm = LLM(model=str(d), tensor_parallel_size=tp, **ENGINE)
            out[f"{name}{tp}"] = run(llm, prompts, 8)
            llm.llm_engine.shutdown()
    return out


def tiny_folder_with_weights(c: dict = TINY) -> str:
    """A tiny config (default TINY) with random safetensors weights (numpy): real tensors,
    for `convert` and for outputs that depend on every weight."""
    import numpy as np
    from safetensors.numpy import save_file
    d, rng = tiny_folder(c), np.random.default_rng(0)
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    t = {"model.embed_tokens.weight": rng.normal(0, 0.5, (c["vocab_size"], h)),
         "model.norm.weight": np.ones(h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update({p + "input_layernorm.weight": np.ones(h), p + "post_attention_layernorm.weight": np.ones(h),
                  p + "self_attn.q_proj.weight": rng.normal(0, 0.2, (c["num_attention_heads"] * hd, h)),
                  p + "self_attn.k_proj.weight": rng.normal(0, 0.2, (c["num_key_value_heads"] * hd, h)),
                  p + "self_attn.v_proj.weight": rng.normal(0, 0.2, (c["num_key_value_heads"] * hd, h)),
                  p + "self_attn.o_proj.weight": rng.normal(0, 0.2, (h, c["num_attention_heads"] * hd)),
                  p + "mlp.gate_proj.weight": rng.normal(0, 0.2, (i, h)),
                  p + "mlp.up_proj.weight": rng.normal(0, 0.2, (i, h)),
                  p + "mlp.down_proj.weight": rng.normal(0, 0.2, (h, i))})
    save_file({k: v.astype(np.float32) for k, v in t.items()}, os.path.join(d, "model.safetensors"))
    return d


if __name__ == "__main__":
    print("TP_RESULT " + json.dumps(main(sys.argv[1])), flush=True)
