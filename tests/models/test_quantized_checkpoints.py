"""Quantized checkpoints as their tools publish them, written here by the tests from a tiny
random Llama: vLLM's fp8 format (per-tensor scales, static input scales), llm-compressor's
compressed-tensors fp8 (per-channel), AutoAWQ's GEMM int4 (interleaved nibbles) and GPTQ int4
(act-order g_idx, zero points stored minus one), each packed here from the layouts' own
descriptions, not with jaxkv's code; and llm-compressor's pack-quantized int4 (per group with
zero points, per channel symmetric, bfloat16 scales) written and dequantized by the
compressed-tensors library itself. transformers runs the same model with the dequantized
float weights. jaxkv's logits equal those within 1e-3 relative (prefill, chunks and decode),
and its greedy tokens equal transformers' on 4 prompts."""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file as save_numpy

from jaxkv.loader.hf import load_hf_dir
from jaxkv.models.llama import LlamaModel
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.params import params_from_tensors
from jaxkv.quantization import resolve
from tests.models.hf_compare import assert_logits_match, greedy_reference
from tests.models.test_architectures import COMMON

GROUP = 32
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# each expert's layers (Mixtral's w1 / w3 / w2, Qwen's) and a shared expert's
EXPERTS = re.compile(r"(experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)"
                     r"|shared_expert\.(gate|up|down)_proj)$")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ packs column order_map[k] into nibble k


def _int4_groups(w, groups):
    """Round-to-nearest 4-bit with a zero point per group (lists of input indices) and output
    channel: (q uint8 [in, out], zeros uint8 [G, out], scales float16 [G, out]); w float [in, out]."""
    q = np.zeros(w.shape, np.uint8)
    zeros = np.zeros((len(groups), w.shape[1]), np.uint8)
    scales = np.zeros((len(groups), w.shape[1]), np.float16)
    for g, rows in enumerate(groups):
        lo, hi = w[rows].min(0), w[rows].max(0)
        s = (np.maximum(hi - lo, 1e-6) / 15).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), 1, 15)  # >= 1: GPTQ stores z - 1
        q[rows] = np.clip(np.round(w[rows] / s.astype(np.float32)) + z, 0, 15)
        zeros[g], scales[g] = z, s
    return q, zeros, scales


def _pack8(values, axis):
    """Eight 4-bit values per int32 along `axis`, value 8j + k in nibble k (GPTQ's order)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = sum(v[..., k] << (4 * k) for k in range(8))
    return np.moveaxis(packed.astype(np.uint32).view(np.int32), -1, axis)


def _awq(w):
    """AutoAWQ GEMM tensors of w [out, in] and its dequantized float32 [out, in]."""
    wt = w.T
    groups = [list(range(i, i + GROUP)) for i in range(0, wt.shape[0], GROUP)]
    q, z, s = _int4_groups(wt, groups)
    inter = lambda a: a.reshape(a.shape[0], -1, 8)[:, :, AWQ_PACK_ORDER].reshape(a.shape)  # noqa: E731
    tensors = {"qweight": _pack8(inter(q), 1), "qzeros": _pack8(inter(z), 1), "scales": s}
    deq = (q.astype(np.float32) - np.repeat(z, GROUP, 0)) * np.repeat(s.astype(np.float32), GROUP, 0)
    return tensors, deq.T


def _gptq(w, rng):
    """GPTQ (act-order) tensors of w [out, in] and its dequantized float32 [out, in]."""
    wt = w.T
    order = rng.permutation(wt.shape[0])  # the act-order: groups in this order of the inputs
    groups = [order[i:i + GROUP] for i in range(0, wt.shape[0], GROUP)]
    q, z, s = _int4_groups(wt, groups)
    g_idx = np.empty(wt.shape[0], np.int32)
    for g, rows in enumerate(groups):
        g_idx[rows] = g
    tensors = {"qweight": _pack8(q, 0), "qzeros": _pack8(z - 1, 1), "scales": s, "g_idx": g_idx}
    deq = (q.astype(np.float32) - z[g_idx]) * s[g_idx].astype(np.float32)
    return tensors, deq.T


def _fp8(w, per_channel):
    """fp8 e4m3 weight and its scale (per tensor, or [out, 1] per channel), and the dequantized."""
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max()
    scale = (np.asarray(amax, np.float32) / 448.0).astype(np.float32)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(-1, 1) if per_channel else scale.reshape(())}, \
        q.astype(np.float32) * scale


def _ct_int4(w, strategy):
    """compressed-tensors' own pack-quantized int4 tensors of w [out, in] (round to nearest
    with its qparams: per group of GROUP with zero points, or per channel symmetric; scales in
    bfloat16 as llm-compressor writes a bfloat16 model's) and its own dequantized [out, in]."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme(strategy)
    t = torch.from_numpy(w)
    lo_hi = t.reshape(t.shape[0], -1, GROUP) if strategy == "group" else t[:, None, :]
    scale, zp = calculate_qparams(lo_hi.amin(-1), lo_hi.amax(-1), scheme.weights)
    state = {"weight": t, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zp}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    # dequantized in float32 (the bfloat16 scales' values widened), not rounded to bfloat16
    deq = PackedQuantizationCompressor.decompress(
        {**packed, "weight_scale": packed["weight_scale"].float()}, scheme)["weight"]
    tensors = {k: v if v.dtype == torch.bfloat16 else v.numpy() for k, v in packed.items()}
    return tensors, deq.float().numpy()


def _ct_int4_actorder(w, rng):
    """compressed-tensors int4 with actorder group, as llm-compressor wrote it before that
    library dropped it: each input's group in weight_g_idx (a random balanced assignment), the
    values packed in the inputs' own order, scales and zero points per group. The library
    quantizes the group-ordered columns; its packing helpers put them back in order."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    n_in = w.shape[1]
    order = rng.permutation(n_in)  # the inputs in group order
    tensors, deq = _ct_int4(np.ascontiguousarray(w[:, order]), "group")
    back = np.argsort(order)
    values = unpack_from_int32(torch.from_numpy(tensors["weight_packed"]), 4, torch.Size(w.shape))
    tensors["weight_packed"] = pack_to_int32(values[:, torch.from_numpy(back)].contiguous(), 4).numpy()
    g_idx = np.empty(n_in, np.int32)
    g_idx[order] = np.arange(n_in) // GROUP
    tensors["weight_g_idx"] = g_idx
    return tensors, np.ascontiguousarray(deq[:, back])


def _ct_actorder_config():
    config = _ct_config("group")  # the library refuses actorder group now: set it in the JSON
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return config


def _ct_scheme(strategy):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    args = dict(group_size=GROUP, symmetric=False) if strategy == "group" else dict(symmetric=True)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy=strategy, actorder="static", **args))


def _ct_config(strategy):
    from compressed_tensors.quantization import QuantizationConfig
    return QuantizationConfig(config_groups={"group_0": _ct_scheme(strategy)},
                              format="pack-quantized", ignore=["lm_head"],
                              quantization_status="compressed").model_dump(mode="json")


QUANT_CONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
            "dynamic": False}, "input_activations": {"num_bits": 8, "type": "float",
                                                     "strategy": "token", "dynamic": True}}}},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
             "sym": False, "checkpoint_format": "gptq"},
    "compressed-tensors:int4-group": lambda: _ct_config("group"),
    "compressed-tensors:int4-channel": lambda: _ct_config("channel"),
    "compressed-tensors:int4-actorder": _ct_actorder_config,
}


def _write(fmt, path, config: dict = COMMON):
    """A tiny Llama (`config`: transformers LlamaConfig fields) in format `fmt` at `path` (a
    pathlib.Path), and transformers' model with the dequantized weights."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**config, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    state = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    tensors = _quantize_tensors(fmt, state)
    hf.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()})
    _save_quantized(fmt, tensors, {**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}, path)
    return hf


def _quantize_tensors(fmt, state: dict) -> dict:
    """The checkpoint tensors of float `state` (HF names -> float32 [out, in]) in format
    `fmt`: every linear layer's (attention, MLP, each expert's and a shared expert's; not a
    router or the shared expert's gate) quantized; `state` gets their dequantized weights."""
    rng = np.random.default_rng(0)
    tensors = {}
    for name, w in list(state.items()):
        prefix = name[:-len(".weight")]
        if not name.endswith(".weight") or not (any(prefix.endswith(x) for x in LINEARS)
                                                 or EXPERTS.search(prefix)):
            tensors[name] = w
            continue
        if fmt in ("fp8", "compressed-tensors"):
            t, deq = _fp8(w, per_channel=fmt == "compressed-tensors")
            if fmt == "fp8":
                t["input_scale"] = np.asarray(0.05, np.float32)
        elif fmt == "compressed-tensors:int4-actorder":
            t, deq = _ct_int4_actorder(w, rng)
        elif fmt.startswith("compressed-tensors:"):
            t, deq = _ct_int4(w, fmt.split("-")[-1])
        else:
            t, deq = _awq(w) if fmt == "awq" else _gptq(w, rng)
        tensors.update({f"{prefix}.{k}": v for k, v in t.items()})
        state[name] = deq
    return tensors


def _save_quantized(fmt, tensors: dict, config: dict, path) -> None:
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
    fp8 = {k for k, v in tensors.items() if not isinstance(v, torch.Tensor)
           and v.dtype == ml_dtypes.float8_e4m3fn}
    _save(tensors, fp8, path / "model.safetensors")
    qc = QUANT_CONFIGS[fmt]
    config = {**config, "quantization_config": qc() if callable(qc) else qc}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(path)


def _write_moe(fmt, path, name="qwen2_moe", **overrides):
    """A tiny MoE of family `name` (tests/models/test_moe.py; a shared expert of 64 so that
    groups of 32 divide it; config fields `overrides` changed) in format `fmt` at `path`, and
    transformers' model loaded from a folder of its dequantized float weights."""
    from jaxkv.loader.hf import load_hf_tensors
    from tests.models.test_moe import MOE, make_moe
    make_moe(name, path / "float", shared_expert_intermediate_size=64, **overrides)
    state = {k: np.asarray(v, np.float32) for k, v in load_hf_tensors(path / "float").items()}
    tensors = _quantize_tensors(fmt, state)
    config = json.loads((path / "float" / "config.json").read_text())
    _save_quantized(fmt, tensors, config, path)
    save_numpy({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()},
               str(path / "float" / "model.safetensors"))
    return MOE[name][1].from_pretrained(str(path / "float")).eval()


def _save(tensors, fp8, file):
    """safetensors through torch where numpy has no float8 (or a tensor is torch's bfloat16)."""
    if not fp8 and not any(isinstance(v, torch.Tensor) for v in tensors.values()):
        return save_numpy(tensors, str(file))
    from safetensors.torch import save_file
    out = {k: (v if isinstance(v, torch.Tensor)
               else torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn) if k in fp8
               else torch.from_numpy(np.ascontiguousarray(v))) for k, v in tensors.items()}
    save_file(out, str(file))


def assert_greedy_tokens(llm, hf, what: str) -> None:
    """The engine's 12 greedy tokens on 4 random prompts equal transformers'."""
    from jaxkv import SamplingParams
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, COMMON["vocab_size"], n).tolist() for n in (5, 9, 17, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == greedy_reference(hf, p, 12), what


@pytest.fixture(scope="module", params=list(QUANT_CONFIGS))
def quantized(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param.replace("-", "_").replace(":", "_"))
    return request.param, _write(request.param, path), path


def test_logits_equal_the_dequantized_float_model(quantized):
    fmt, hf, path = quantized
    ckpt = load_hf_dir(str(path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    spec = resolve(None, ckpt.config, "cpu")
    assert spec.name == fmt.split(":")[0] and not spec.online
    model = LlamaModel(mc, quant=spec)
    params = params_from_tensors(model, ckpt.tensors)
    leaves = params["layers_0"]["q_proj"]
    assert "kernel" not in leaves or leaves["kernel"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert_logits_match(hf, model, params, mc, COMMON["vocab_size"], 1e-3, fmt,
                        quantization_config=ckpt.config["quantization_config"])


def test_greedy_tokens_equal_transformers(quantized):
    from jaxkv import LLM

    fmt, hf, path = quantized
    llm = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
    s = llm.stats()
    assert s.quantization == fmt.split(":")[0]
    float_bytes = sum(p.numel() * 4 for p in hf.parameters())
    assert s.weights_bytes < float_bytes
    assert_greedy_tokens(llm, hf, fmt)


@pytest.mark.parametrize("fmt", list(QUANT_CONFIGS))
def test_a_quantized_mixture_of_experts(fmt, tmp_path):
    """A tiny Qwen2-MoE (every expert's layers and the shared expert's quantized, the router
    and the shared expert's gate float) in each format: logits within 1e-3 of transformers on
    the dequantized weights, its greedy tokens, and the weights' bytes as jaxkv plan counts
    them."""
    from jaxkv import LLM
    from jaxkv.quantization import weights_bytes
    hf = _write_moe(fmt, tmp_path)
    ckpt = load_hf_dir(str(tmp_path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    spec = resolve(None, ckpt.config, "cpu")
    model = LlamaModel(mc, quant=spec)
    params = params_from_tensors(model, ckpt.tensors)
    assert set(params["layers_0"]["mlp"]["gate_proj"]) >= {"qweight", "scales"} | (
        {"kernel"} if spec.method == "fp8" else set()) or spec.method == "fp8"
    assert_logits_match(hf, model, params, mc, COMMON["vocab_size"], 1e-3, fmt,
                        quantization_config=ckpt.config["quantization_config"])
    llm = LLM(model=str(tmp_path), max_model_len=128, max_num_batched_tokens=64,
              token_buckets=(8, 64), kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
    s = llm.stats()
    assert s.quantization == fmt.split(":")[0] and s.weights_bytes == weights_bytes(mc, 4, spec)
    assert_greedy_tokens(llm, hf, fmt)
