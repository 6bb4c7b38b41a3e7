"""The sparse MLP of a mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE), in Flax.

As transformers' MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock:
router logits x @ router [T, E] in float32, softmax, the top-k experts of each token (their
weights renormalized to sum to 1 with norm_topk_prob), each expert a SwiGLU
(down(silu(gate(x)) * up(x))), the token's output the weighted sum of its experts'; Qwen2-MoE
adds a shared expert scaled by sigmoid(x @ shared_expert_gate).

The experts run as grouped matmuls over the (token, expert) pairs sorted by expert
(jax.lax.ragged_dot with each expert's row count), so a step computes T * k expert rows, not
T * E. Parameters (leaves of the layer's "mlp"): router [hidden, E], gate_proj and up_proj
[E, hidden, moe_intermediate], down_proj [E, moe_intermediate, hidden]; the shared expert
is a dense gated MLP (Linear modules) beside them. Quantized (`quant`), each of gate_proj,
up_proj and down_proj is instead a module of the format's leaves stacked per expert
(jaxkv/quantization/linear.py declare_experts), widened to the model's dtype for the grouped
matmul (the weights are held quantized; the step reads them whole, as every expert's
weights are); the shared expert's layers are quantized like a dense MLP's, its gate and the
router stay in the model's dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv.models.model_config import ModelConfig
from jaxkv.quantization import QuantSpec
from jaxkv.quantization import linear as qlinear


class QuantizedExperts(nn.Module):
    """The stacked leaves of `num` quantized experts' [in, out] layers."""
    spec: QuantSpec
    num: int
    in_features: int
    out: int

    @nn.compact
    def __call__(self) -> dict:
        return qlinear.declare_experts(self, self.spec, self.num, self.in_features, self.out)


class MoE(nn.Module):
    """x [T, hidden] -> (y [T, hidden] in `dtype`, int32 [E]: the real tokens (`valid`, bool
    [T]; None: all) routed to each expert). The counts are also sown as the intermediate
    "expert_load" (read by the runner when it asks for them: ModelRunner.step_fn)."""
    cfg: ModelConfig
    dtype: jnp.dtype
    linear: type  # jaxkv.models.llama.Linear (the shared expert's layers)
    matmul: object  # jaxkv.models.llama.matmul bound to the model's cpu flag
    quant: QuantSpec | None = None

    def experts(self, name: str, in_features: int, out: int):
        """An expert weight [E, in, out] in the model's dtype (quantized ones widened)."""
        c, dt = self.cfg, self.dtype
        if self.quant is None:
            return self.param(name, nn.initializers.normal(0.02), (c.num_experts, in_features, out), dt)
        leaves = QuantizedExperts(self.quant, c.num_experts, in_features, out, name=name)()
        return qlinear.dequantize_experts(leaves, self.quant, dt)

    @nn.compact
    def __call__(self, x, valid=None):
        c, dt = self.cfg, self.dtype
        h, e, i, k = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.num_experts_per_tok
        router = self.param("router", nn.initializers.normal(0.02), (h, e), dt)
        w_gate, w_up = self.experts("gate_proj", h, i), self.experts("up_proj", h, i)
        w_down = self.experts("down_proj", i, h)
        x = x.astype(dt)
        probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, k)  # [T, k]
        if c.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # the (token, expert) pairs grouped by expert
        token = order // k
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        real = flat if valid is None else jnp.where(jnp.repeat(valid, k), flat, e)  # e: dropped
        self.sow("intermediates", "expert_load", jnp.bincount(real, length=e).astype(jnp.int32))
        xs = x[token]
        act = nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(xs, w_up, sizes)
        ys = jax.lax.ragged_dot(act, w_down, sizes) * weights.reshape(-1)[order][:, None].astype(dt)
        y = jnp.zeros_like(x).at[token].add(ys)
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            q = self.quant
            g, u = self.matmul(x, self.linear(s, False, dt, q, name="shared_gate_proj"),
                               self.linear(s, False, dt, q, name="shared_up_proj"))
            shared = self.matmul(nn.silu(g) * u, self.linear(h, False, dt, q, name="shared_down_proj"))[0]
            gate = self.matmul(x, self.linear(1, False, dt, name="shared_expert_gate"))[0]
            y = y + jax.nn.sigmoid(gate) * shared
        return y, sizes
