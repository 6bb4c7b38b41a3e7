"""`jaxkv convert`: the embedded GGUF converted to params in an orbax checkpoint (plus config and
tokenizer files) loads back into exactly the same params, tokenizer and chat template, and an
engine on the folder generates what the embedded model does; bad folders fail in one line.
The orbax side runs in a process of its own (tests/loader/converted_check.py says why)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_check(*args) -> dict:
    p = subprocess.run([sys.executable, "-m", "tests.loader.converted_check", *map(str, args)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
    line = next((x for x in p.stdout.splitlines() if x.startswith("CONVERTED ")), None)
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[len("CONVERTED "):])


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    return run_check(tmp_path_factory.mktemp("converted") / "smollm2")


def test_mixtures_of_experts_and_gemma_convert(tmp_path):
    """A converted Mixtral, Qwen2-MoE (shared expert), Gemma 2 and Gemma 3 give their Hugging
    Face folders' greedy tokens."""
    assert run_check("--families", tmp_path) == {"mixtral": True, "qwen2_moe": True,
                                                 "gemma2": True, "gemma3": True}


def test_engine_on_the_folder_is_the_embedded_model(checked):
    assert checked["seconds"] > 0 and checked["is_converted"] == [True, False]
    assert checked["threads_left"] == []  # the synchronous checkpointer leaves none behind
    assert checked["same_tree"] and checked["same_params"]
    assert checked["same_template"] and checked["same_output"]


def test_bad_folders_fail_in_one_line(checked, tmp_path):
    e = checked["errors"]
    assert "not empty" in e["not_empty"]
    assert "cannot restore" in e["other_model"]
    assert "_broken" in e["broken"]
    p = subprocess.run([sys.executable, "-m", "jaxkv.cli", "convert", str(tmp_path / "x.gguf"),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("jaxkv: error:") \
        and len(p.stderr.strip().splitlines()) == 1, p.stderr
