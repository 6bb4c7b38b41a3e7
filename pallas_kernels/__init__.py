"""Paged-attention kernels (Pallas, Triton lowering) and the oracle they must equal.

paged_attention: decode-only (one query token per sequence). ragged_paged_attention: prefill
chunks and decodes in one call, with the semantics of reference.ragged_paged_attention_reference
(a short dense-gather oracle). Both run natively on an NVIDIA GPU, and with interpret=True on a
CPU.
"""

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["paged_attention", "ragged_paged_attention", "ragged_paged_attention_reference"]
