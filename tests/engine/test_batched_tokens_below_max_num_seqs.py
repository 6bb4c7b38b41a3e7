"""EngineArgs rejects max_num_batched_tokens below max_num_seqs (an "also" item handed with the
cases of 2026-11-30)."""

from __future__ import annotations

import pytest

from jaxkv.engine_args import EngineArgs


def test_budget_below_max_num_seqs_is_rejected():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be greater than or "
                                         r"equal to max_num_seqs \(32\)"):
        EngineArgs(max_num_batched_tokens=16, max_num_seqs=32)
    EngineArgs(max_num_batched_tokens=32, max_num_seqs=32)  # equal is fine
