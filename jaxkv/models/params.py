"""Hugging Face tensors -> the Flax parameter tree of LlamaModel, and dummy (random) weights.

HF names (model.layers.{i}.self_attn.q_proj.weight, torch layout [out, in]) become
layers_{i}/q_proj/kernel [in, out].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention.kv_pool import new_kv_pool
from jaxkv.models.model_config import ModelConfig
from jaxkv.quantization import gguf
from jaxkv.quantization.gguf import GGUFBlocks
from jaxkv.quantization import linear as qlinear
from jaxkv.quantization.load import linear_leaves
from jaxkv.step_input import StepInput

_LAYER_MAP = {  # flax module -> (HF suffix, transpose)
    "input_layernorm": ("input_layernorm", False),
    "post_attention_layernorm": ("post_attention_layernorm", False),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm", False),
    "post_feedforward_layernorm": ("post_feedforward_layernorm", False),
    "q_proj": ("self_attn.q_proj", True), "k_proj": ("self_attn.k_proj", True),
    "v_proj": ("self_attn.v_proj", True), "o_proj": ("self_attn.o_proj", True),
    "q_norm": ("self_attn.q_norm", False), "k_norm": ("self_attn.k_norm", False),
    "gate_proj": ("mlp.gate_proj", True), "up_proj": ("mlp.up_proj", True),
    "down_proj": ("mlp.down_proj", True),
}


def param_shapes(model) -> dict:
    """The parameter tree of `model` as jax.ShapeDtypeStruct, without allocating anything."""
    c = model.cfg
    # A pool of the weights' dtype, laid out as the runner's (bfloat16 held as bits).
    pool = jax.eval_shape(lambda: new_kv_pool((c.num_layers, 2, 1, c.num_kv_heads, c.head_dim),
                                              model.dtype))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    from jaxkv.models.llama import rope_inv_freq
    f32 = jax.ShapeDtypeStruct((1, rope_inv_freq(c).shape[0]), jnp.float32)
    step = StepInput(i32(1), i32(1), i32(1), i32(1, 1), i32(1), i32(2), i32(1), i32(1), f32, f32,
                     i32(1))
    shapes = jax.eval_shape(lambda step, kv: model.init(
        jax.random.PRNGKey(0), step, kv, method=type(model).forward_and_logits), step, pool)
    return shapes["params"]


# A fused model's modules (LlamaModel.fused_projections) and the modules they join, in order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def unfused(model):
    """`model` in the layout checkpoints, converted folders and random weights are made in
    (itself when it is): projections apart, a module per layer; `to_layout` then fuses and
    stacks them as `model` wants."""
    if getattr(model, "fused_projections", False) or getattr(model, "scan_layers", False):
        return model.clone(fused_projections=False, scan_layers=False)
    return model


def to_layout(model, params: dict) -> dict:
    """Params of the unfused layout -> `model`'s: projections fused (fuse_projections), then
    the layers stacked (stack_layers), as it asks. ValueError for quantized projections asked
    to fuse, or layers that differ (ModelConfig.scan_refusal) asked to stack."""
    if model.fused_projections:
        params = fuse_projections(params)
    if model.scan_layers:
        why = model.cfg.scan_refusal(model.quant is not None, False)
        if why:  # (LlamaModel.setup refuses it too)
            raise ValueError(f"scan_layers: {why}")
        params = stack_layers(params, model.cfg.num_layers)
    return params


def stack_layers(params: dict, num_layers: int) -> dict:
    """Params with a module per layer ("layers_0" .. "layers_{L-1}") -> those of
    LlamaModel(scan_layers=True), in place: every leaf of the layers stacked along a new
    leading axis [num_layers, ...] under "layers". Leaf by leaf, each layer's arrays of that
    leaf dropped once its stack exists, so the device holds one leaf's arrays twice at most
    (a caller that keeps no other reference to them): at Llama-3-8B's shapes in bfloat16,
    fused, gate_up_proj's 7.5 GB on top of the 16 GB of weights. Returns `params`.
    ValueError when the layers' trees differ (a mixture of dense and MoE layers, say)."""
    layers = [params.pop(f"layers_{i}") for i in range(num_layers)]
    paths = [jax.tree_util.tree_structure(x) for x in layers]
    if any(p != paths[0] for p in paths):
        raise ValueError("scan_layers: the decoder layers' params differ in structure")
    flat = [jax.tree_util.tree_flatten(x)[0] for x in layers]
    del layers
    stacked = []
    for j in range(len(flat[0])):
        stacked.append(jnp.stack([leaves[j] for leaves in flat]))
        for leaves in flat:
            leaves[j] = None  # (this leaf's per-layer arrays go now)
    params["layers"] = jax.tree_util.tree_unflatten(paths[0], stacked)
    return params


def fuse_projections(params: dict) -> dict:
    """Params of the unfused layout -> those of LlamaModel(fused_projections=True), in place:
    in each layer, q_proj/k_proj/v_proj's kernels [hidden, n_i] (and biases [n_i]) concatenated
    along their outputs into qkv_proj, gate_proj/up_proj's into gate_up_proj (a mixture-of-
    experts layer's "mlp" is left as it is). Layer by layer, each layer's unfused arrays
    dropped once its fused ones exist, so the device holds one layer's projections twice at
    most (a caller that keeps no other reference to them). Returns `params`. Float kernels
    only: ValueError for a quantized layer."""
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        for fused, parts in FUSED.items():
            if parts[0] not in layer:
                continue
            if set(layer[parts[0]]) - {"kernel", "bias"}:
                raise ValueError(f"{name}/{parts[0]}: only float weights are fused, not {sorted(layer[parts[0]])}")
            leaves = [layer.pop(m) for m in parts]
            layer[fused] = {leaf: jnp.concatenate([x[leaf] for x in leaves], axis=-1) for leaf in leaves[0]}
            del leaves  # (the unfused arrays go now)
    return params


def split_projections(layer: dict, c: ModelConfig) -> dict:
    """A layer's params with q_proj/k_proj/v_proj and gate_proj/up_proj as their own modules
    again (slices of the fused weights; `layer` itself when it is not fused): for code that
    reads the projections by name (the benchmarks' dense model and step profile)."""
    if "qkv_proj" not in layer:
        return layer
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {k: v for k, v in layer.items() if k not in FUSED}
    for fused, cuts in (("qkv_proj", (q, q + kv)), ("gate_up_proj", (c.intermediate_size,))):
        if fused in layer:
            pieces = {leaf: jnp.split(a, cuts, axis=-1) for leaf, a in layer[fused].items()}
            for i, m in enumerate(FUSED[fused]):
                out[m] = {leaf: parts[i] for leaf, parts in pieces.items()}
    return out


def params_from_tensors(model, tensors: dict[str, np.ndarray]) -> dict:
    """Build LlamaModel params from HF-named arrays; every shape is checked against the model
    (its projections fused after, when the model fuses them).

    Raises ValueError naming the tensor that is missing or has the wrong shape.
    """
    if model is not unfused(model):
        return to_layout(model, params_from_tensors(unfused(model), tensors))
    c: ModelConfig = model.cfg
    shapes = param_shapes(model)

    def get(name):
        if name not in tensors:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        t = tensors[name]
        return t if isinstance(t, GGUFBlocks) else np.asarray(t)

    out = {"embed_tokens": _embedding(model, get("model.embed_tokens.weight")),
           "norm": {"weight": get("model.norm.weight")}}
    if not c.tie_word_embeddings:
        out["lm_head"] = {"kernel": get("lm_head.weight").T}
    for i in range(c.num_layers):
        layer = out[f"layers_{i}"] = {}
        for mod, leaves in shapes[f"layers_{i}"].items():
            if mod == "mlp":  # a mixture of experts: below
                continue
            hf, transpose = _LAYER_MAP[mod]
            prefix = f"model.layers.{i}.{hf}"
            if transpose and model.quant is not None:  # a quantized linear layer
                n_in, n_out = _linear_dims(c, mod)
                layer[mod] = linear_leaves(model.quant, get, prefix, n_in, n_out)
                if "bias" in leaves:
                    layer[mod]["bias"] = get(f"{prefix}.bias")
                continue
            layer[mod] = {}
            for leaf in leaves:
                a = get(f"{prefix}.{'bias' if leaf == 'bias' else 'weight'}")
                layer[mod][leaf] = a.T if transpose and leaf == "kernel" else a
        if "mlp" in shapes[f"layers_{i}"]:
            layer["mlp"] = moe_leaves(c, get, i, model.quant)
    return _checked(shapes, out)


# HF names of a MoE layer's tensors: (prefix, router, experts' (gate, up, down)) per family
_MOE_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", "gate", ("w1", "w3", "w2"))}
_QWEN_MOE_NAMES = ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))


def moe_leaves(c: ModelConfig, get, i: int, quant=None) -> dict:
    """Layer i's sparse MLP from HF tensors (torch layout [out, in]; experts stacked); with
    `quant` each expert's layers in that format (linear_leaves), stacked leaf by leaf."""
    prefix, router, (gate, up, down) = _MOE_NAMES.get(c.architecture, _QWEN_MOE_NAMES)
    p = f"model.layers.{i}.{prefix}"
    h, m = c.hidden_size, c.moe_intermediate_size

    def stack(name, n_in, n_out):
        names = [f"{p}.experts.{e}.{name}" for e in range(c.num_experts)]
        if quant is None:
            return np.stack([np.asarray(get(f"{n}.weight")).T for n in names])
        each = [linear_leaves(quant, get, n, n_in, n_out) for n in names]
        return {k: np.stack([x[k] for x in each]) for k in each[0]}

    out = {"router": np.asarray(get(f"{p}.{router}.weight")).T,
           "gate_proj": stack(gate, h, m), "up_proj": stack(up, h, m), "down_proj": stack(down, m, h)}
    if c.shared_expert_intermediate_size:
        s = c.shared_expert_intermediate_size
        for mod, (n_in, n_out) in (("gate_proj", (h, s)), ("up_proj", (h, s)), ("down_proj", (s, h))):
            name = f"{p}.shared_expert.{mod}"
            out[f"shared_{mod}"] = ({"kernel": np.asarray(get(f"{name}.weight")).T} if quant is None
                                    else linear_leaves(quant, get, name, n_in, n_out))
        out["shared_expert_gate"] = {"kernel": np.asarray(get(f"{p}.shared_expert_gate.weight")).T}
    return out


def _embedding(model, table) -> dict:
    """The embedding's leaves: the float table [vocab, hidden], or gguf blocks kept."""
    bits = model.quant.embedding_bits if model.quant is not None else None
    if bits is None:
        return {"embedding": table.dequantize() if isinstance(table, GGUFBlocks) else table}
    if not isinstance(table, GGUFBlocks):
        table = gguf.quantize(np.asarray(table, np.float32), bits)
    return gguf.leaves(table, bits)


def _checked(shapes, out):
    """`out` as device arrays of the dtypes `shapes` declares; ValueError naming a leaf whose
    shape differs."""
    def check(path, want, got):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"tensor for {name} has shape {tuple(got.shape)}, model expects {tuple(want.shape)}")
        return jnp.asarray(got, dtype=want.dtype)

    return jax.tree_util.tree_map_with_path(check, shapes, out)


def _linear_dims(c: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a decoder layer's linear module."""
    q, kv, h, m = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}[module]


def dummy_params(model, seed: int = 0) -> dict:
    """Random weights of the configured shapes (load_format="dummy"): normal(0, 0.02), norms 1;
    quantized leaves drawn on the device in their own format, weights of about that size
    (jaxkv/quantization/linear.py dummy_leaf: an 8B model's in seconds). A model that fuses its
    projections (or stacks its layers) gets the unfused layout's weights fused (stacked): the
    same values."""
    if model is not unfused(model):
        return to_layout(model, dummy_params(unfused(model), seed))
    shapes = param_shapes(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    key = jax.random.PRNGKey(seed)
    out = []
    for i, (path, s) in enumerate(leaves):
        names = [str(getattr(p, "key", p)) for p in path]
        last, k = names[-1], jax.random.fold_in(key, i)
        if last == "weight":
            out.append(jnp.ones(s.shape, s.dtype))
        elif last == "bias":
            out.append(jnp.zeros(s.shape, s.dtype))
        elif model.quant is not None and last in qlinear.LEAVES and (last != "kernel" or s.dtype != model.dtype):
            spec = qlinear.embedding_spec(model.quant) if names[0] == "embed_tokens" else model.quant
            out.append(qlinear.dummy_leaf(last, s.shape, s.dtype, k, spec))
        else:
            out.append((0.02 * jax.random.normal(k, s.shape)).astype(s.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)
