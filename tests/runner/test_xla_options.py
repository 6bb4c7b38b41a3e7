"""The step programs' XLA options (jaxkv/runner/xla_options.py): on a GPU XLA:GPU's dot merger
off and loops in the command buffer (XLA's default command types, checked against the installed
jaxlib, plus WHILE) unless XLA_FLAGS names them, nothing elsewhere; one the jaxlib refuses is
dropped with a warning; the options reach the jax.jit of the step and of multi-step's k-step
program, and no other program's."""

import jax
import pytest

from benchmarks.xla_defaults import is_default
from jaxkv.runner import model_runner
from jaxkv.runner.xla_options import (COMMAND_TYPES, GPU_STEP_OPTIONS, SCAN_OPTIONS,
                                     XLA_DEFAULT_TYPES, accepted_options, compile_one_op,
                                     step_compiler_options)
from tests.helpers import write_tiny_model
from tests.runner.test_compilation import TINY_CONFIG


def test_options_by_platform_and_xla_flags():
    merger, graphs = "xla_gpu_dot_merger_threshold_mb", "xla_gpu_enable_command_buffer"
    assert step_compiler_options("gpu", "") == GPU_STEP_OPTIONS
    assert GPU_STEP_OPTIONS[merger] == 0
    types = GPU_STEP_OPTIONS[graphs].split(",")  # XLA's defaults and multi-step's loop
    assert set(types) == set(XLA_DEFAULT_TYPES.split(",")) | {"WHILE"} and len(types) == len(set(types))
    assert step_compiler_options("cpu", "") == {} and step_compiler_options("tpu", "") == {}
    assert step_compiler_options("gpu", "--xla_gpu_dot_merger_threshold_mb=32 --xla_dump_to=x") == {
        graphs: GPU_STEP_OPTIONS[graphs]}
    assert step_compiler_options("gpu", "--xla_gpu_enable_command_buffer=") == {merger: 0}
    both = "--xla_gpu_enable_command_buffer=FUSION --xla_gpu_dot_merger_threshold_mb=32"
    assert step_compiler_options("gpu", both) == {}
    # scanned layers: cuBLAS reads each layer's slice of a stacked weight in place
    assert step_compiler_options("gpu", "", scan=True) == {**GPU_STEP_OPTIONS, **SCAN_OPTIONS}
    assert SCAN_OPTIONS == {"xla_gpu_enable_dynamic_slice_fusion": True}
    assert step_compiler_options("cpu", "", scan=True) == {}


def test_an_option_this_jaxlib_refuses_is_dropped_with_a_warning(caplog):
    """A jaxlib that does not know an option (renamed or removed) or a value (a command type)
    fails every compile naming it: the one-op program finds it, and the step programs get
    the rest (a command type XLA names as invalid leaves the others in its list); each
    warning names what was dropped and XLA's message. This jaxlib takes ours."""
    assert accepted_options(GPU_STEP_OPTIONS, compile_one_op) == GPU_STEP_OPTIONS
    graphs = "xla_gpu_enable_command_buffer"
    asked = {"xla_gpu_no_such_option": 1, **GPU_STEP_OPTIONS,
             graphs: COMMAND_TYPES.replace("CUDNN,", "NOT_A_TYPE,CUDNN,") + ",NOR_THIS", **SCAN_OPTIONS}
    with caplog.at_level("WARNING", logger="jaxkv"):
        got = accepted_options(asked, compile_one_op)
    assert got == {**GPU_STEP_OPTIONS, **SCAN_OPTIONS}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 3, warned
    assert "xla_gpu_no_such_option=1" in warned[0] and "No such compile option" in warned[0]
    assert "NOT_A_TYPE refused" in warned[1] and "not a valid enum value" in warned[1]
    assert "NOR_THIS refused" in warned[2]
    tried = []
    assert step_compiler_options("gpu", "", try_compile=tried.append) == GPU_STEP_OPTIONS
    assert tried == [GPU_STEP_OPTIONS]  # one compile when all are taken; none off a GPU
    assert step_compiler_options("cpu", "", try_compile=tried.append) == {} and len(tried) == 1


def test_a_failure_that_is_no_refusal_of_ours_is_raised():
    """Only XLA's refusals of a compile option count, and only of the option tried: an out
    of memory, or ptxas refusing its own option (a toolchain too old for the GPU), is raised
    rather than taken for a refusal of every option."""
    def fails_with(message):
        def try_compile(options):
            raise RuntimeError(message)
        return try_compile
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        accepted_options(GPU_STEP_OPTIONS, fails_with("RESOURCE_EXHAUSTED: out of memory"))
    with pytest.raises(RuntimeError, match="ptxas"):
        accepted_options(GPU_STEP_OPTIONS, fails_with("ptxas: Value 'sm_90a' is not defined for option 'gpu-name'"))
    with pytest.raises(RuntimeError, match="other_option"):  # a refusal naming none of ours
        accepted_options(GPU_STEP_OPTIONS, fails_with("No such compile option: 'other_option'"))


def test_the_default_check_runs_once_per_process(monkeypatch):
    from jaxkv.runner import xla_options
    calls = []
    monkeypatch.setattr(xla_options, "compile_one_op", calls.append)
    xla_options._accepted_here.cache_clear()
    try:
        for _ in range(3):
            assert step_compiler_options("gpu", "") == GPU_STEP_OPTIONS
        assert calls == [GPU_STEP_OPTIONS]
    finally:
        xla_options._accepted_here.cache_clear()


def test_the_default_command_types_are_this_jaxlibs():
    """XLA_DEFAULT_TYPES is the installed jaxlib's default list (fails when a jaxlib changes
    it: the step options would then drop or miss a type), and a list without CONDITIONAL is
    not; the dot merger's threshold is not 0 by default (the option changes something)."""
    assert is_default("xla_gpu_enable_command_buffer", XLA_DEFAULT_TYPES)
    no_conditional = XLA_DEFAULT_TYPES.replace("CONDITIONAL,", "")
    assert no_conditional != XLA_DEFAULT_TYPES and not is_default("xla_gpu_enable_command_buffer", no_conditional)
    assert not is_default("xla_gpu_dot_merger_threshold_mb", 0)


def test_xla_parses_every_command_type(tmp_path):
    """The command types are names this jaxlib knows (a name it does not know fails the
    compile: 'not a valid enum value'), and the option sets the whole list: XLA's dump of the
    program's debug options holds exactly these types."""
    import os
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp\n"
            "from jaxkv.runner.xla_options import GPU_STEP_OPTIONS, SCAN_OPTIONS\n"
            "o = {**GPU_STEP_OPTIONS, **SCAN_OPTIONS}\n"
            "jax.jit(lambda x: x + 1, compiler_options=o).lower(jnp.ones(3)).compile()\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to={tmp_path}"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    dumped = [f for f in os.listdir(tmp_path) if f.endswith("jit__lambda.debug_options")]
    assert len(dumped) == 1, os.listdir(tmp_path)
    text = (tmp_path / dumped[0]).read_text()
    got = {line.split(":")[1].strip() for line in text.splitlines()
           if line.startswith("xla_gpu_enable_command_buffer:")}
    assert got == set(GPU_STEP_OPTIONS["xla_gpu_enable_command_buffer"].split(","))
    assert "xla_gpu_dot_merger_threshold_mb: 0" in text
    assert "xla_gpu_enable_dynamic_slice_fusion: true" in text


def test_the_step_programs_get_the_options(tmp_path, monkeypatch):
    """On the CPU with the GPU's options forced (XLA:CPU accepts and ignores this one): the
    step's and the k-step program's jits get them, the sampler's and the gathers' do not, and
    the engine compiles and decodes as without them."""
    from jaxkv import LLM, SamplingParams
    folder = write_tiny_model(tmp_path, TINY_CONFIG)
    engine = dict(load_format="dummy", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
                  kv_cache_memory_bytes=1 << 20, token_buckets=(4, 16), num_scheduler_steps=2)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    want = [o.outputs[0].token_ids for o in LLM(model=folder, **engine).generate(prompts, sp, use_tqdm=False)]
    real, seen = jax.jit, []

    def spy(f, **kw):
        seen.append((getattr(f, "__name__", ""), kw.get("compiler_options")))
        return real(f, **kw)

    monkeypatch.setattr(model_runner, "step_compiler_options", lambda platform, scan=False: dict(GPU_STEP_OPTIONS))
    monkeypatch.setattr(jax, "jit", spy)
    llm = LLM(model=folder, **engine)
    monkeypatch.setattr(jax, "jit", real)
    with_options = [name for name, opts in seen if opts == GPU_STEP_OPTIONS]
    assert sorted(with_options) == ["run", "step_fn"], seen  # (multi_step.program's function: run)
    assert sum(opts is None for _, opts in seen) >= 3  # gather, sampler, prompt logprobs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want and llm.stats().num_multi_steps > 0
