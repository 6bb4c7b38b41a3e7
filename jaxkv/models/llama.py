"""Llama-family decoder in Flax (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE: jaxkv/models/moe.py) over a paged KV pool.

Matches Hugging Face transformers' LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM numerics: RMSNorm in float32, rotate-half RoPE (with llama3 scaling), grouped-
query attention, SwiGLU MLP, q/k/v biases for Qwen2, per-head q/k RMSNorm for Qwen3.

The layers are a Python loop over per-layer modules (each with its own weight arrays; with
scan_layers one nn.scan over their stacked weights instead), all sharing the stacked KV pool
(jaxkv.attention.KVPool: [num_layers, num_blocks, block_size, num_kv_heads, head_dim], with
scales when quantized); layer i writes its K/V at the slot mapping, then attends through the
engine's attention backend with the layer index, so no layer of the pool is ever sliced out or
copied. (Measured on the 2-core CPU: an nn.scan over stacked weights compiles 5x faster but
decodes ~1.7x slower, because every iteration copies its layer's weights out of the stack.)
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import Attention, get_attention, write_and_attend
from jaxkv.cpu_kernels import linear as cpu_linear
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.moe import MoE
from jaxkv.quantization import QuantSpec
from jaxkv.quantization import linear as qlinear
from jaxkv.step_input import StepInput, input_ids


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64 -> float32), linear and llama3 scaling as
    in transformers' _compute_linear_scaling_rope_parameters / _compute_llama3_parameters.
    With a local RoPE base (Gemma 3) the local layers' unscaled ones follow:
    [head_dim] = global ++ local (LlamaModel splits the tables)."""
    glob = _inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_local_theta is None:
        return glob
    return np.concatenate([glob, _inv_freq(cfg.head_dim, cfg.rope_local_theta, None)])


def _inv_freq(d: int, theta: float, scaling) -> np.ndarray:
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    if scaling and dict(scaling).get("rope_type", dict(scaling).get("type")) == "linear":
        return (inv / dict(scaling)["factor"]).astype(np.float32)
    if scaling:
        rs = dict(scaling)
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x, cos, sin):
    """x [T, heads, D]; cos/sin float32 [T, D / 2] (StepInput.rope_cos / rope_sin): rotate-half
    RoPE as transformers' apply_rotary_pos_emb, x1 * cos - x2 * sin and x2 * cos + x1 * sin
    for the halves x1, x2 of each head (each half contiguous, so XLA vectorizes it)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, None], sin[:, None]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm in float32: Llama's w * x.astype(dtype); with `offset` Gemma's
    (x * (1 + w)).astype(dtype) (its weights stored as w, about 0)."""
    eps: float
    dtype: jnp.dtype
    offset: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + w.astype(jnp.float32))).astype(self.dtype)
        return w * xf.astype(self.dtype)


def softcap(x, cap: float | None):
    """Gemma's tanh soft-capping: cap * tanh(x / cap) (None: x)."""
    return x if cap is None else jnp.tanh(x / cap) * cap


class Linear(nn.Module):
    """A linear layer's weights: {"kernel": [in, out]} (the transpose of torch's weight) in the
    model's dtype, or the leaves of its quantized format (jaxkv/quantization/linear.py), and
    bias [out] (or None); `matmul` applies them."""
    features: int
    use_bias: bool
    dtype: jnp.dtype
    quant: QuantSpec | None = None

    @nn.compact
    def __call__(self, in_features: int):
        if self.quant is not None:
            weights = qlinear.declare(self, self.quant, in_features, self.features)
        else:
            weights = {"kernel": self.param("kernel", nn.initializers.normal(0.02),
                                            (in_features, self.features), self.dtype)}
        bias = (self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
                if self.use_bias else None)
        return weights, bias


def matmul(x, layers, cpu: bool) -> list:
    """x [T, in] -> [x @ kernel (+ bias), [T, out_i] for each Linear of `layers`], computed in
    the layers' dtype. Quantized layers dequantize inside the matmul (qlinear.apply). With
    `cpu` (LlamaModel.cpu_matmul), an x of at most cpu_linear.MAX_ROWS float32 rows goes
    through jaxkv's C++ kernel in one call for all the layers (jaxkv/cpu_kernels/linear.py);
    otherwise each is an XLA dot."""
    weights = [layer(x.shape[-1]) for layer in layers]
    quant, dtype = layers[0].quant, layers[0].dtype
    if quant is not None:
        ys = [qlinear.apply(x, w, quant, dtype) for w, _ in weights]
    else:
        kernels = [w["kernel"] for w, _ in weights]
        x = x.astype(kernels[0].dtype)  # as flax's Dense: computed in the layer's dtype
        if cpu and cpu_linear.applies(x, *kernels):
            ys = cpu_linear.matmul(x, *kernels)
        else:
            ys = [x @ k for k in kernels]
    return [y if b is None else y + b for y, (_, b) in zip(ys, weights)]


class QuantizedEmbed(nn.Module):
    """The embedding kept in quantized blocks (gguf): leaves [hidden, vocab], the LM head's
    orientation (jaxkv/quantization/linear.py). `__call__(ids)` -> [T, hidden] (only those
    columns dequantized); `attend(x)` -> x @ table^T [T, vocab]."""
    vocab_size: int
    hidden_size: int
    dtype: jnp.dtype
    quant: QuantSpec

    def setup(self):
        self.weights = qlinear.declare(self, self.quant, self.hidden_size, self.vocab_size)

    def __call__(self, ids):
        return qlinear.take_columns(self.weights, ids, self.quant, self.dtype)

    def attend(self, x):
        return qlinear.apply(x, self.weights, self.quant, self.dtype)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    attention: Attention
    cpu_matmul: bool = False
    quant: QuantSpec | None = None
    fused: bool = False  # LlamaModel.fused_projections
    scanned: bool = False  # LlamaModel.scan_layers: `layer` is traced, every layer alike

    @nn.compact
    def __call__(self, carry, layer, rope, step: StepInput, shared):
        x, pool = carry
        c, dt, qs = self.cfg, self.dtype, self.quant
        static = 0 if self.scanned else layer  # (ModelConfig.scan_refusal: none differs)
        t = x.shape[0]
        norm = lambda name: RMSNorm(c.rms_norm_eps, dt, c.gemma, name=name)  # noqa: E731
        h = norm("input_layernorm")(x)
        mm = lambda x, *layers: matmul(x, layers, self.cpu_matmul)  # noqa: E731
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if self.fused:  # one weight [hidden, q ++ k ++ v]: one matmul
            qkv = mm(h, Linear(nq + 2 * nkv, c.attention_bias, dt, qs, name="qkv_proj"))[0]
            q, k, v = jnp.split(qkv, [nq, nq + nkv], axis=-1)
        else:
            q, k, v = mm(h, Linear(nq, c.attention_bias, dt, qs, name="q_proj"),
                         Linear(nkv, c.attention_bias, dt, qs, name="k_proj"),
                         Linear(nkv, c.attention_bias, dt, qs, name="v_proj"))
        q = q.reshape(t, c.num_heads, c.head_dim)
        k = k.reshape(t, c.num_kv_heads, c.head_dim)
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = norm("q_norm")(q)
            k = norm("k_norm")(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o, pool = write_and_attend(self.attention, q, k, v, pool, step, shared, layer=layer,
                                   scale=c.attn_scale or c.head_dim ** -0.5,
                                   window=c.window(static), softcap=c.attn_softcap)
        o = mm(o.reshape(t, -1), Linear(c.hidden_size, False, dt, qs, name="o_proj"))[0]
        if c.gemma:  # Gemma's norms after attention and around the MLP
            x = x + norm("post_attention_layernorm")(o)
            h = norm("pre_feedforward_layernorm")(x)
        else:
            x = x + o
            h = norm("post_attention_layernorm")(x)
        if static in c.moe_layers:  # a sparse MLP (jaxkv/models/moe.py)
            valid = step.slot_mapping > 0  # not padding (nor a multi-step's row past its steps)
            y, _ = MoE(c, dt, Linear, mm, qs, name="mlp")(h, valid)
            return (x + y, pool), None
        if self.fused:  # one weight [hidden, gate ++ up]
            g, u = jnp.split(mm(h, Linear(2 * c.intermediate_size, False, dt, qs, name="gate_up_proj"))[0],
                             2, axis=-1)
        else:
            g, u = mm(h, Linear(c.intermediate_size, False, dt, qs, name="gate_proj"),
                      Linear(c.intermediate_size, False, dt, qs, name="up_proj"))
        act = nn.gelu(g, approximate=True) if c.mlp_activation == "gelu_tanh" else nn.silu(g)
        y = mm(act * u, Linear(c.hidden_size, False, dt, qs, name="down_proj"))[0]
        if c.gemma:
            y = norm("post_feedforward_layernorm")(y)
        return (x + y, pool), None


class LlamaModel(nn.Module):
    """__call__(step: StepInput, kv: KVPool) -> (hidden [T, hidden_size] after the final norm,
    the pool updated); `logits(hidden)` -> float32 [rows, vocab_size]. `attention`: the backend
    chosen at engine build (jaxkv.attention.get_attention); `cpu_matmul`: steps and sampler
    calls of at most cpu_linear.MAX_ROWS rows run their float32 matmuls through jaxkv's C++
    kernels (set by the engine with the cpu attention backend and no tensor parallelism);
    `quant`: the decoder layers' linear weights quantized (jaxkv/quantization; the embedding
    and the LM head stay in `dtype`); `fused_projections`: each dense layer's q/k/v weights as
    one [hidden, q + 2 kv] weight (qkv_proj) and its gate/up weights as one [hidden, 2 x
    intermediate] weight (gate_up_proj), one matmul each, as vLLM's QKVParallelLinear and
    MergedColumnParallelLinear (float weights, one device; jaxkv/models/params.py fuses a
    checkpoint's); `scan_layers`: the decoder layers' params stacked ([num_layers, ...] under
    "layers", jaxkv/models/params.py stack_layers) and run by one `nn.scan` (a loop in the
    step program) instead of unrolled: for models whose layers are all alike
    (ModelConfig.scan_refusal); `scan_unroll`: that loop's layers per trip (num_layers: the
    layers unrolled again, each reading a static slice of the stacked weights: few argument
    leaves without a loop)."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    attention: Attention = get_attention("xla")
    cpu_matmul: bool = False
    quant: QuantSpec | None = None
    fused_projections: bool = False
    scan_layers: bool = False
    scan_unroll: int = 1  # layers per trip of the scan's loop (num_layers: no loop, static slices)

    def setup(self):
        c = self.cfg
        if self.quant is not None and self.quant.embedding_bits:
            self.embed_tokens = QuantizedEmbed(c.vocab_size, c.hidden_size, self.dtype,
                                               qlinear.embedding_spec(self.quant), name="embed_tokens")
        else:
            self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                         param_dtype=self.dtype, name="embed_tokens")
        args = (c, self.dtype, self.attention, self.cpu_matmul, self.quant, self.fused_projections)
        if self.scan_layers:
            why = c.scan_refusal(self.quant is not None, False)
            if why:  # (every layer would run with layer 0's window, RoPE and MLP kind)
                raise ValueError(f"scan_layers: {why}")
            self.layer_scan = nn.scan(DecoderLayer, variable_axes={"params": 0},
                                      split_rngs={"params": True}, length=c.num_layers,
                                      unroll=self.scan_unroll,
                                      in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast))(
                *args, scanned=True, name="layers")
        else:
            self.layers = [DecoderLayer(*args, name=f"layers_{i}") for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, c.gemma, name="norm")
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.vocab_size, False, self.dtype, name="lm_head")

    def __call__(self, step: StepInput, kv):
        x = self.embed_tokens(input_ids(step))
        if self.cfg.gemma:  # scaled by sqrt(hidden_size), rounded to the weights' dtype
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, self.dtype)
        rope = (step.rope_cos, step.rope_sin)  # from the host: see StepInput
        local = rope
        if self.cfg.rope_local_theta is not None:  # [T, D]: global ++ local (rope_inv_freq)
            half = self.cfg.head_dim // 2
            local = tuple(t[:, half:] for t in rope)
            rope = tuple(t[:, :half] for t in rope)
        carry = (x, kv)
        shared = self.attention.prepare(step, kv.k.shape[2])  # once per step, for every layer
        if self.scan_layers:
            layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
            carry, _ = self.layer_scan(carry, layers, local if self.cfg.window(0) else rope, step, shared)
        else:
            for i, layer in enumerate(self.layers):
                carry, _ = layer(carry, i, local if self.cfg.window(i) else rope, step, shared)
        x, kv = carry
        return self.norm(x), kv

    def forward_and_logits(self, step: StepInput, kv):
        """Both halves at once; used to create every parameter (lm_head included) at init."""
        hidden, kv = self(step, kv)
        return self.logits(hidden), kv

    def logits(self, hidden):
        """float32 [rows, vocab_size] of hidden [rows, hidden_size] (soft-capped for Gemma)."""
        return softcap(self._raw_logits(hidden), self.cfg.final_softcap)

    def _raw_logits(self, hidden):
        if not self.cfg.tie_word_embeddings:
            return matmul(hidden, [self.lm_head], self.cpu_matmul)[0].astype(jnp.float32)
        if isinstance(self.embed_tokens, QuantizedEmbed):
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        table = self.embed_tokens.embedding  # [vocab, hidden]: x @ table^T
        if self.cpu_matmul and cpu_linear.applies(hidden, table, transposed=True):
            return cpu_linear.matmul(hidden, table, transposed=True)[0]
        return self.embed_tokens.attend(hidden).astype(jnp.float32)
