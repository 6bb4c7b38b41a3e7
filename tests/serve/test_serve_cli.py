"""`jaxkv serve` flag errors are one line, exit status 2, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serve.server import served_model_name


@pytest.mark.parametrize("argv,words", [
    (["a.gguf", "--model", "b.gguf"], "two models given"),
    (["/no/such/model.gguf"], "no such file or folder"),
    (["--port", "70000"], "--port"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--block-size", "x"], "--block-size"),
    (["--metrics-prefix", "vllm:x"], "--metrics-prefix"),
])
def test_bad_serve_flags_give_one_line(argv, words):
    p = subprocess.run([sys.executable, "-m", "jaxkv.cli", "serve", *argv], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxkv: error:") and words in lines[0], p.stderr


def test_served_model_name():
    assert served_model_name(None, None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/qwen", None) == "/models/qwen"
    assert served_model_name("/models/qwen", "qwen") == "qwen"
