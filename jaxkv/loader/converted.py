"""Converted checkpoints: jaxkv's own params in an orbax checkpoint, made once by `jaxkv convert`.

A converted folder holds:
  config.json   the model's Hugging Face-style config (as every loader returns it);
  tokenizer files, written by the tokenizer's save_pretrained (chat template included);
  params/       an orbax StandardCheckpointer checkpoint of the LlamaModel parameter tree,
                float32 (GGUF weights are dequantized, HF weights cast: lossless either way).
`LLM(model=folder)` and `jaxkv serve folder` restore params/ straight into arrays of the
engine's dtype, each placed on its target device by its sharding (orbax reads every array
into that placement, no full host copy per device), skipping the GGUF dequantization or the
safetensors renaming and transposes of a first load.
"""

from __future__ import annotations

import json
import os
import time

from jaxkv.loader.source import PARAMS, load_checkpoint


def convert(model: str | None, out_dir: str) -> float:
    """Convert `model` (None = the embedded GGUF, a .gguf file or an HF folder) into a converted
    folder at `out_dir`, which must not exist or be empty. Returns the seconds it took.
    Raises ValueError for a non-empty out_dir, a quantized checkpoint (other than a GGUF
    file, whose blocks are dequantized), FileNotFoundError for a
    missing model."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.models.params import params_from_tensors

    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"output folder {out_dir!r} exists and is not empty")
    t0 = time.perf_counter()
    ckpt = load_checkpoint(model)
    method = (ckpt.config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "gguf"):  # a GGUF file's blocks are dequantized: lossless
        raise ValueError(f"jaxkv convert writes float weights; this checkpoint is quantized "
                         f"(quantization_config.quant_method {method!r}): serve it directly")
    params = params_from_tensors(LlamaModel(ModelConfig.from_hf_config(ckpt.config),
                                            dtype=jnp.float32), ckpt.tensors)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(ckpt.config, f, indent=1)
    ckpt.tokenizer.save_pretrained(out_dir)
    with _checkpointer() as c:
        c.save(os.path.abspath(os.path.join(out_dir, PARAMS)), args=ocp.args.StandardSave(params))
    return time.perf_counter() - t0


def _checkpointer():
    """orbax's synchronous checkpointer of the standard (pytree of arrays) format: it starts
    no background thread that outlives the call (the async StandardCheckpointer's did, and
    raced other threads of the process at exit)."""
    import orbax.checkpoint as ocp
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def restore_params(path: str, model, mesh=None) -> dict:
    """The params of `model` (a LlamaModel) from the converted folder `path`, as arrays of the
    model's dtype on the default device, or with a tensor-parallel `mesh` each restored
    straight into its sharding (jaxkv/models/sharding.py: every device reads its own slice).
    ValueError naming the folder when the checkpoint does not hold this model's parameter tree.
    The folder holds the projections apart, a module per layer: a model that fuses them or
    stacks its layers gets them so after (jaxkv/models/params.py to_layout)."""
    import jax
    import orbax.checkpoint as ocp

    from jaxkv.models.params import param_shapes, to_layout, unfused

    if model is not unfused(model):
        return to_layout(model, restore_params(path, unfused(model), mesh))
    shapes = param_shapes(model)
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda s: device, shapes)
    else:
        from jaxkv.models.sharding import param_shardings
        shardings = param_shardings(shapes, model.cfg, mesh)
    target = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, model.dtype, sharding=d),
                          shapes, shardings)
    try:
        with _checkpointer() as c:
            return c.restore(os.path.abspath(os.path.join(path, PARAMS)),
                             args=ocp.args.StandardRestore(target))
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the folder
        raise ValueError(f"converted checkpoint {path!r}: cannot restore its params for this "
                         f"model ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
