"""ModelRunner: owns the params and the KV pool, packs each step's arrays, runs the jitted step.

The step `(params, kv_cache, StepInput) -> (hidden, kv_cache)` is ONE jitted function whose
KV pool is donated (updated in place, never copied), compiled ahead of time per token bucket
(and per bucket once more for decode-only steps with a decode kernel; compiler.py): the
warmup buckets before the engine is ready, the others in a background thread; a step pads to
the smallest bucket compiled so far. A plain step samples inside it
(jaxkv/sampling/fused_sampling.py); logprobs, penalties, grammar and draft rows run in small
sampler programs (RowSampler, jaxkv/sampling/row_sampler.py), so those variants do not
multiply the model's programs. Multi-step decode: jaxkv/runner/multi_step.py.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention.kv_pool import new_kv_pool
from jaxkv.core.scheduler_output import RunnerOutput, SchedulerOutput
from jaxkv.cpu_kernels import linear as cpu_linear
from jaxkv.engine_config import EngineConfig
from jaxkv.models.llama import LlamaModel, rope_inv_freq
from jaxkv.runner import multi_step as ms
from jaxkv.models import sharding as sh
from jaxkv.runner.buckets import num_rows, pick_bucket, sample_row_counts, sample_rows
from jaxkv.runner.compile_counter import CompileCounter
from jaxkv.runner.compiler import BackgroundCompiler, Programs, compile_buckets, compile_workers
from jaxkv.runner.input_builder import build_step_input, pending_sources, rope_tables
from jaxkv.runner.kv_offload import KVOffload
from jaxkv.runner.launcher import Launcher
from jaxkv.runner.run_ahead import RunAhead
from jaxkv.runner.xla_options import step_compiler_options
from jaxkv.sampling import fused_sampling as fs
from jaxkv.sampling import rows
from jaxkv.sampling import sampler as smp
from jaxkv.sampling.row_sampler import RowSampler, prompt_logprobs_body, sample_body
from jaxkv.step_input import StepInput

logger = logging.getLogger("jaxkv")


class ModelRunner(RunAhead):
    def __init__(self, model: LlamaModel, params, config: EngineConfig,
                 kv_disk_dir: str | None = None, leader=None):
        """model/params: the Flax model and its weights; config: the engine's resolved record
        (pool size, buckets, max_model_len, max_num_seqs, max_logprobs, enforce_eager, the
        host tier's blocks); kv_disk_dir: the disk tier's folder of this model identity
        (jaxkv.core.disk_tier.DiskTier.dir) or None; leader: a multi-process engine's
        jaxkv.runner.multiprocess.Leader on process 0 (sends each step to the other processes
        before running it), None in one process and on a follower."""
        rc, cc = config.runner, config.cache
        self.config = config
        self.model, self.params = model, params
        self.block_size, self.max_model_len = cc.block_size, config.max_model_len
        self.max_num_seqs, self.token_buckets = config.scheduler.max_num_seqs, rc.token_buckets
        self.max_blocks = -(-self.max_model_len // self.block_size)
        # RoPE's (cos, sin) of every position, looked up by each step's StepInput
        self.rope_table = rope_tables(np.arange(self.max_model_len), rope_inv_freq(model.cfg))
        self.max_logprobs, self.vocab_size = rc.max_logprobs, model.cfg.vocab_size
        spec = config.speculative
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        # Steps (and sampler calls) of at most this many rows run their matmuls through the
        # C++ kernel (LlamaModel.cpu_matmul); 0 when the model does not use it.
        self.cpu_matmul_max_rows = cpu_linear.MAX_ROWS if model.cpu_matmul else 0
        # Step programs of at most this many tokens sample a plain step's tokens themselves
        # (jaxkv/sampling/fused_sampling.py); 0 at run time: off, the programs unchanged.
        self.fused_sampling_max_tokens = self.fused_program_max_tokens = fs.max_tokens(rc.tensor_parallel_size)
        self.num_fused_sampling_steps = 0  # steps dispatched that way (run-ahead ones included)
        self.last_sampled_tokens = None  # the last forward()'s fused sampling output, if any
        self.expert_load = None  # MoE: int32 [E] on the device, tokens per expert (all steps)
        self.num_blocks = cc.num_blocks
        self._place(params, rc.tensor_parallel_size)
        self.weights_bytes = sum(sh.bytes_per_device(self.params))  # all shards, as packed
        self.enforce_eager = enforce_eager = rc.enforce_eager
        self.mark_decode_only = model.attention.uses_decode_only
        self.warmup_token_buckets = rc.warmup_token_buckets
        # A decode-only step holds at most max_num_seqs tokens, and the warmup buckets are
        # always compiled, so it never pads beyond this bucket: decode-only programs up to it.
        self.decode_max = (pick_bucket(self.warmup_token_buckets, self.max_num_seqs)
                           if self.mark_decode_only else 0)
        # Buckets whose programs are all compiled ahead of time (warmup, then the background
        # compiler); steps pad to these. Until warmup runs (or with enforce_eager) every
        # bucket is usable and a missing step program compiles on first use; with
        # enforce_eager every bucket is listed (usable, nothing compiled ahead of time).
        self.compiled_token_buckets: tuple[int, ...] = self.token_buckets if enforce_eager else ()
        self._usable_buckets = self.token_buckets
        self.background: BackgroundCompiler | None = None
        self.leader = leader
        # The host and disk tiers' copies (jaxkv.runner.kv_offload.KVOffload) when they are on.
        if (kv_disk_dir is None) != (cc.kv_cache_disk_dir is None):
            raise ValueError("kv_disk_dir must be given exactly when the config has a disk tier")
        self.offload = (KVOffload(self.kv_cache, cc.num_host_blocks, kv_disk_dir)
                        if cc.num_host_blocks else None)
        self.compiles = CompileCounter()  # every program this runner's calls compile
        self.compile_workers = compile_workers()  # warmup's compile threads
        # Async scheduling (jaxkv/runner/lookahead.py, run_ahead.py; off with a mesh, several
        # processes or drafts): sampled tokens padded to prev_rows rows, read on the device by
        # a step run ahead (StepInput.prev_sampled); the step run ahead; how many (used: one
        # took it).
        self.prev_rows = self.max_num_seqs if rc.async_scheduling else 0
        self._make_programs(self.params, enforce_eager)
        self.async_scheduling = rc.async_scheduling

    def _place(self, params, tensor_parallel_size: int) -> None:
        """Tensor parallelism (jaxkv/models/sharding.py): a mesh and the params placed on it
        (None and the params as given on one device); then the KV pool and its spec."""
        self.mesh, self.params = sh.place_params(params, self.model.cfg, tensor_parallel_size,
                                                 self.config.runner.expert_parallel)
        self.kv_cache = self._new_kv_cache()
        self.kv_spec = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if self.mesh else None),
            self.kv_cache)

    def _make_programs(self, params, enforce_eager: bool) -> None:
        """The jitted step and the sampler's programs (plain functions with enforce_eager)."""
        jit = (lambda f, **kw: f) if enforce_eager else jax.jit
        # The jitted step (params, kv_cache, StepInput) -> (hidden, kv_cache), pool donated;
        # with a mesh, its inputs and outputs placed as sharding.py says (XLA partitions it).
        # The step programs' XLA options (xla_options.py), multi-step's k-step ones' too.
        self.step_options = step_compiler_options(jax.default_backend(), scan=self.model.scan_layers)
        step_jit = functools.partial(jit, compiler_options=self.step_options or None)
        if self.mesh is not None and not enforce_eager:
            pool_sh = jax.tree.map(lambda x: x.sharding, self.kv_cache)
            rep = sh.replicated(self.mesh)
            self.jitted_step = step_jit(self.step_fn, donate_argnums=(1,),
                                        in_shardings=(jax.tree.map(lambda x: x.sharding, params),
                                                      pool_sh, rep),
                                        out_shardings=(rep, pool_sh, rep))
        else:
            self.jitted_step = step_jit(self.step_fn, donate_argnums=(1,))
        # The sampled rows are gathered by a small program of their own, so the sampler's
        # programs depend on the row count only (token buckets 64 and 512 share them).
        # With a mesh their outputs are replicated: every process reads the sampled tokens
        # from its own devices (a multi-process mesh has devices no process can read all of).
        out = {} if self.mesh is None or enforce_eager else {"out_shardings": sh.replicated(self.mesh)}
        self.programs = Programs(
            gather_rows=jit(lambda hidden, idx: hidden[idx], **out),
            sample=jit(sample_body(self._logits, self.model.cpu_matmul, self.prev_rows),
                       static_argnames=("mode", "num_logprobs"), **out),
            prompt_logprobs=jit(prompt_logprobs_body(self._logits),
                                static_argnames=("num_logprobs",), **out))
        self.sampler = RowSampler(self.programs, vocab_size=self.vocab_size,
                                  max_model_len=self.max_model_len, max_logprobs=self.max_logprobs)
        k = self.config.scheduler.num_scheduler_steps  # multi-step decode: its k-step programs
        self.multi_step = (ms.MultiStep(self.step_fn, k, self.block_size, self.rope_table, self.compiles,
                                        self.prev_rows, self.model.cfg.num_experts, step_jit) if k > 1 else None)
        # (compiled with each bucket a decode step of up to max_num_seqs sequences pads to)
        self.multi_step_max_tokens = min((t for t in self.token_buckets if t >= self.max_num_seqs),
                                         default=self.token_buckets[-1])
        # Async scheduling's step run ahead is dispatched from a thread of its own (launcher.py;
        # launch_ahead: a run-time switch, False dispatches it on the engine thread)
        self.launcher = Launcher() if self.prev_rows and not enforce_eager and self.mesh is None else None
        self.launch_ahead = True

    def step_fn(self, params, kv_cache, step: StepInput):
        """The model step, not jitted: (params, KVPool, StepInput) -> (hidden
        [T, hidden_size], pool with this step's K/V written, extras):
        extras["sampled"] in programs that fuse sampling (step.sampling given), int32 [P or R],
        each sequence's last row's token (zeros when step.sample_mode is 0);
        extras["expert_load"] for a mixture of experts, int32 [E], the real tokens each
        expert took this step summed over the MoE layers (jaxkv/models/moe.py)."""
        extras = {}
        if self.model.cfg.num_experts:
            (hidden, kv_cache), state = self.model.apply({"params": params}, step, kv_cache,
                                                         mutable=["intermediates"])
            loads = [v for path, v in jax.tree_util.tree_leaves_with_path(state)
                     if "expert_load" in jax.tree_util.keystr(path)]
            extras["expert_load"] = jnp.sum(jnp.stack(loads), axis=0)
        else:
            hidden, kv_cache = self.model.apply({"params": params}, step, kv_cache)
        if step.sampling is not None:
            extras["sampled"] = smp.pad_rows(fs.sampled_tokens(
                lambda h: self._logits(params, h), hidden, step, self.model.cpu_matmul), self.prev_rows)
        return hidden, kv_cache, extras

    def _logits(self, params, hidden):
        return self.model.apply({"params": params}, hidden, method=LlamaModel.logits)

    def sample_row_counts(self, t: int) -> tuple[int, ...]:
        """Every sampler row count a token-bucket-t step can use (compiled with the bucket)."""
        return sample_row_counts(t, self.max_num_seqs, self.num_speculative_tokens)

    @property
    def num_compilations(self) -> int:
        """XLA programs this runner compiled (or loaded from the persistent cache), warmup
        and the background compiler included, as counted by JAX's public compile events."""
        bg = self.background.compiles.programs if self.background is not None else 0
        return self.compiles.programs + bg

    def add_compiled_bucket(self, t: int) -> None:
        """Switch bucket `t` in: every program of it is compiled (jaxkv.runner.compiler)."""
        self.compiled_token_buckets = tuple(sorted({*self.compiled_token_buckets, t}))
        self._usable_buckets = self.compiled_token_buckets  # one assignment: thread-safe

    def pick_bucket(self, out: SchedulerOutput) -> int:
        """The token bucket of a step: the smallest compiled one holding its tokens
        (ValueError if none does)."""
        return pick_bucket(self._usable_buckets, out.total_num_scheduled_tokens)

    def build_inputs(self, out: SchedulerOutput, bucket: int | None = None) -> StepInput:
        """The StepInput of a SchedulerOutput, padded to `bucket` tokens (default: its
        pick_bucket)."""
        t = self.pick_bucket(out) if bucket is None else bucket
        return build_step_input(out, block_size=self.block_size, num_tokens=t,
                                rows=num_rows(t, self.max_num_seqs), max_blocks=self.max_blocks,
                                rope_table=self.rope_table,
                                mark_decode_only=self.mark_decode_only, prev_rows=self.prev_rows,
                                fused_sampling=t <= self.fused_program_max_tokens)

    def forward(self, step: StepInput) -> jax.Array:
        """Run the jitted step: write the step's K/V into the pool (donated, updated in place)
        and return hidden float [T, hidden_size] (after the final norm). The step program of
        (T, step.decode_only) is compiled ahead of time (warmup or the background compiler),
        or here on first use when no warmup ran. `last_sampled_tokens` is then the program's
        fused sampling output (int32 [P or R]; None in programs without one). A call in
        flight on the launcher's thread is waited for first (it updates the pool), unless
        this is that call."""
        if self.launcher is not None:
            self.launcher.join()
        with self.compiles:
            hidden, self._kv, extras = self._run_step(self.params, self._kv, step)
        self.last_sampled_tokens = extras.get("sampled")
        self._count_experts(extras.get("expert_load"))
        return hidden

    def _count_experts(self, load) -> None:
        if load is not None:  # a device add: nothing waits for it
            self.expert_load = load if self.expert_load is None else self.expert_load + load

    def _run_step(self, params, kv_cache, step: StepInput):
        if self.enforce_eager:
            return self.jitted_step(params, kv_cache, step)
        key = (step.num_tokens, step.decode_only)
        exe = self.programs.step.get(key)
        if exe is None:
            exe = self.programs.step[key] = self.jitted_step.lower(params, kv_cache, step).compile()
        return exe(params, kv_cache, step)

    def _new_kv_cache(self):
        c = self.model.cfg
        shape = (c.num_layers, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        dtype = jnp.dtype(self.config.runner.kv_cache_dtype)  # the weights' or narrower
        if self.mesh is None:
            return new_kv_pool(shape, dtype)
        shardings = sh.kv_pool_shardings(jax.eval_shape(lambda: new_kv_pool(shape, dtype)), c, self.mesh)
        return jax.jit(lambda: new_kv_pool(shape, dtype), out_shardings=shardings)()  # per shard

    def recover_kv_cache(self) -> bool:
        """After a failed step: True when the KV pool did not survive it (donated to a failed
        program, or holding its error) and was reallocated as zeros (every block's contents
        gone); False when intact. A multi-process leader tells its followers to check theirs."""
        self.num_ahead_discarded += self._ahead is not None
        self._ahead = None
        if self.launcher is not None:
            self.launcher.join(raise_error=False)  # (its error is the one being undone)
        if self.leader is not None:
            self.leader.recovered()
        if self._pool_intact():
            return False
        self.kv_cache = None  # let the old buffers go before the new pool is allocated
        self.kv_cache = self._new_kv_cache()
        return True

    # ---- one step -----------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, bucket: int | None = None) -> RunnerOutput:
        """One step: inputs, the jitted step, then sampling (and prompt logprobs) of its rows.
        `bucket`: the token bucket to pad to (a multi-process follower is given the leader's;
        default: pick_bucket). A multi-process leader sends the step to its followers first
        (jaxkv/runner/multiprocess.py)."""
        if self.leader is not None:
            t = self.pick_bucket(out)
            return self.leader.run(out, t, lambda: self._execute(out, t))
        return self._execute(out, bucket)

    def _execute(self, out: SchedulerOutput, bucket: int | None) -> RunnerOutput:
        ahead = self._take_ahead()
        if out.kv_transfers:  # copies between the KV tiers come first (kv_offload.py)
            self.kv_cache = self.offload.apply(out.kv_transfers, self.kv_cache)
        if not out.scheduled:
            self.num_ahead_discarded += ahead is not None
            return RunnerOutput()
        # Async scheduling (jaxkv/runner/lookahead.py): what the step dispatched ahead
        # computed is taken as it is; the rest runs now (multi-step decodes and the others
        # as a program each, jaxkv/runner/multi_step.py).
        if ahead is not None:  # a steady decode's fast path (steady_batch.py), else split
            steady = self._execute_steady(out, ahead)
            if steady is not None:
                return steady
        reuse, rest, match = self._split(out, ahead)
        res, runs = RunnerOutput(), []
        for part in ms.MultiStep.parts(rest):
            sub = out if len(part) == len(out.scheduled) else SchedulerOutput(part)
            si = self.build_inputs(sub, bucket if part is out.scheduled else None)
            hidden, spans, sampled, si = self._dispatch(sub.scheduled, si)
            runs.append((sub, si, hidden, spans, sampled))
        if self.multi_step is not None and self.multi_step.wanted(out.scheduled):
            self.multi_step.num_steps_run += 1
        if self.async_scheduling:  # the next step, now
            self._ahead = self._run_ahead(out, reuse, ahead, runs, match)
        if reuse:
            ms.collect(self.sampler, res, ahead.sampled, [x for _, x in reuse])
        for sub, si, hidden, spans, sampled in runs:
            if spans:
                ms.collect(self.sampler, res, sampled, spans)
            if any(s.prompt_logprob_targets for s in sub.scheduled):
                with self.compiles:
                    self.sampler.prompt_logprobs_into(self.params, res, hidden, si.query_start_loc, sub, si.num_tokens)
        if self._ahead is not None:
            self._ahead.fill_tokens(res.sampled)
        return res

    def _dispatch(self, scheduled, si: StepInput, launch: bool = False):
        """(hidden or None, spans, sampled, the StepInput dispatched: `si`, with the
        sampler's arrays where its program samples) of step `si` of `scheduled`: a multi-step
        decode's program when some sequence has num_steps > 1 (jaxkv/runner/multi_step.py),
        else _step_and_sample. `launch`: a fused step or a k-step program is dispatched by the
        launcher's thread (sampled is then a Future of its output)."""
        launch = launch and self.launcher is not None and self.launch_ahead
        if self.multi_step is None or not self.multi_step.wanted(scheduled):
            return self._step_and_sample(scheduled, si, launch)
        spans, si, plan = self.multi_step.prepare(scheduled, si)
        if launch:
            return None, spans, self.launcher.launch(self._multi_step_call, si, plan), si
        return None, spans, self._multi_step_call(si, plan), si

    def _multi_step_call(self, si: StepInput, plan):
        """Dispatch a prepared k-step program (on the launcher's thread when launched); its
        MultiOutput, still on the device."""
        sampled, self.kv_cache, load = self.multi_step.call(self.params, self.kv_cache, si, plan)
        self._count_experts(load)
        return sampled

    def _step_and_sample(self, scheduled, si: StepInput, launch: bool = False):
        """Dispatch the step `si` of `scheduled` and the sampling of its rows: (hidden, spans,
        the sampler's output still on the device (None when nothing samples), the StepInput
        dispatched). A plain step samples inside its own program
        (jaxkv/sampling/fused_sampling.py). Rows whose input token is still on the device
        (a step run ahead) have it as their pending last output (pending_sources)."""
        fused = si.sampling is not None and fs.fusable(scheduled, si.num_tokens,
                                                       self.fused_sampling_max_tokens)
        if fused:
            spans = fs.spans(scheduled)
            si = fs.with_sampling(si, spans)
            self.num_fused_sampling_steps += 1
            if launch:  # (a step run ahead: no prompt logprobs, so no hidden needed)
                return None, spans, self.launcher.launch(self._fused_step, si), si
            hidden = self.forward(si)
            return hidden, spans, smp.SamplerOutput(self.last_sampled_tokens, None, None, None, None), si
        hidden = self.forward(si)
        with self.compiles:
            spans, idx = rows.layout(scheduled, si.query_start_loc)
            sampled = (self.sampler.dispatch(self.params, hidden, spans, idx,
                                              sample_rows(si.num_tokens, len(idx), self.max_num_seqs),
                                              pending_sources(si, idx))
                       if spans else None)
        return hidden, spans, sampled, si

    def _fused_step(self, si: StepInput) -> smp.SamplerOutput:
        """Dispatch a step that samples in its program (on the launcher's thread); its
        tokens, still on the device."""
        self.forward(si)
        return smp.SamplerOutput(self.last_sampled_tokens, None, None, None, None)

    def warmup(self) -> tuple[float, int]:
        """Compile every program of the warmup buckets (jaxkv.runner.compiler.compile_buckets,
        on `compile_workers` threads) and switch them in; from here on steps pad to compiled
        buckets only. Returns (seconds, programs compiled)."""
        t0, n0 = time.perf_counter(), self.num_compilations
        with self.compiles:
            compile_buckets(self, self.warmup_token_buckets, workers=self.compile_workers)
        for t in self.warmup_token_buckets:
            self.add_compiled_bucket(t)
        return time.perf_counter() - t0, self.num_compilations - n0

    def start_background_compile(self) -> BackgroundCompiler | None:
        """After warmup: compile the other token buckets on a daemon thread (ascending), each
        used by steps once all its programs exist. None when there are none, or no warmup ran
        (enforce_eager: nothing is compiled ahead of time)."""
        rest = tuple(t for t in self.token_buckets if t not in self.compiled_token_buckets)
        if not rest or not self.compiled_token_buckets or self.background is not None:
            return None
        # (a quarter of warmup's threads: steps come first; one below 8 of them)
        self.background = BackgroundCompiler(self, rest, max(1, self.compile_workers // 4)).start()
        return self.background

    def shutdown(self) -> None:
        """Stop the background compiler (after the program in flight); the runner stays
        usable with the buckets compiled so far."""
        if self.background is not None:
            self.background.stop()
        if self.launcher is not None:
            self.launcher.join(raise_error=False)

