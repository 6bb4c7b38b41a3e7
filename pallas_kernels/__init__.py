"""Paged-attention kernels (Pallas) and the pure-jnp references they must equal."""

from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["ragged_paged_attention_reference"]
