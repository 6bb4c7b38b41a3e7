"""Multi-step decode (vLLM V0's `--num-scheduler-steps k`): up to k decode steps of a batch in
one program, each step's sampled tokens fed back on the device.

The scheduler gives each plain decode of a step (one token; sampling without logprobs,
penalties, logits filters, min_tokens ban or grammar) up to k steps
(ScheduledRequest.num_steps: within max_tokens, max_model_len and the blocks it could
allocate; the step's other sequences run beside them as a program of their own). The
program runs up to k iterations (its longest sequence's steps) of the step program's own
function (the model and its fused sampling, jaxkv/sampling/fused_sampling.py) in a
`lax.fori_loop`: iteration j computes each sequence's position p + j, writes its K/V
there, samples its token with the sampler's per-request key at output position
num_output_tokens + j, and feeds that token to iteration j + 1. Positions, slots, context lengths and RoPE tables of every iteration are
computed on the host (`plan_arrays`): a sequence past its num_steps repeats its last
position with its K/V sent to the null block's slot 0, and its tokens there are dropped.
The host gets [k, R] tokens back; the scheduler appends each sequence's tokens up to its
first stop (EOS, a stop token, max_tokens; a stop string is found by the output processor),
as it appends accepted drafts, so no token past a stop is ever emitted. The tokens equal
single-step decoding's (tests/runner/test_multi_step.py).

What it saves: the host's work per step (schedule, inputs, dispatch, read-back) is paid once
per k decode steps, and the device goes from one decode step to the next without a host
round trip. What it costs: a prompt that arrives waits for the k steps in flight (its
TTFT), and tokens reach the client k at a time.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.sampling import fused_sampling as fs
from jaxkv.sampling import sampler as smp
from jaxkv.step_input import StepInput, input_ids


class MultiOutput(NamedTuple):
    """A k-step program's output, on the device: `tokens` int32 [k, R] (iteration j's token
    of sequence i at [j, i]) and `token_ids` int32 [P], each sequence's last token, the
    input of its next step (a step run ahead gathers it, as from a SamplerOutput's)."""
    tokens: jax.Array
    token_ids: jax.Array


@dataclasses.dataclass(frozen=True)
class PlanArrays:
    """Per-iteration inputs of a k-step program (numpy on the host; k iterations, T token
    rows, R sequence rows, D head_dim): each replaces StepInput's field of the same name."""
    positions: np.ndarray     # int32 [k, T]
    slot_mapping: np.ndarray  # int32 [k, T]
    seq_lens: np.ndarray      # int32 [k, R]
    rope_cos: np.ndarray      # float32 [k, T, D / 2]
    rope_sin: np.ndarray      # float32 [k, T, D / 2]
    num_steps: np.ndarray     # int32 [R]: each sequence's steps (0: a padding row)


jax.tree_util.register_dataclass(PlanArrays, data_fields=[f.name for f in dataclasses.fields(PlanArrays)],
                                 meta_fields=[])


def plan_arrays(si: StepInput, num_steps: np.ndarray, k: int, block_size: int,
                rope_table: tuple[np.ndarray, np.ndarray]) -> PlanArrays:
    """The k iterations' arrays of decode step `si` (built by build_step_input: sequence i's
    one token is row i), `num_steps` int [m] each real sequence's steps (1..k). Sequence i's
    iteration j computes position p_i + min(j, num_steps_i - 1), its K/V going to that
    position's slot while j < num_steps_i and to slot 0 (the null block) after."""
    m, t, r = len(num_steps), si.num_tokens, len(si.seq_lens)
    j = np.arange(k, dtype=np.int32)[:, None]
    live = j < num_steps[None, :]                                  # [k, m]
    off = np.minimum(j, num_steps[None, :] - 1).astype(np.int32)   # [k, m]
    pos = np.zeros((k, t), np.int32)
    pos[:, :m] = si.positions[None, :m] + off
    blocks = si.block_tables[np.arange(m)[None, :], pos[:, :m] // block_size]
    slots = np.zeros((k, t), np.int32)
    slots[:, :m] = np.where(live, blocks * block_size + pos[:, :m] % block_size, 0)
    lens = np.zeros((k, r), np.int32)
    lens[:, :m] = si.seq_lens[None, :m] + off
    steps = np.zeros(r, np.int32)
    steps[:m] = num_steps
    return PlanArrays(pos, slots, lens, rope_table[0][pos], rope_table[1][pos], steps)


def program(step_fn, k: int, prev_rows: int, num_experts: int = 0):
    """The k-step program's function, to be jitted with the pool donated: (params, kv_cache,
    StepInput of a fused-sampling decode step, PlanArrays) -> (MultiOutput (int32 [k, R]
    each iteration's sampled tokens, int32 [P] each sequence's last token: its input to the
    next step, padded to P = `prev_rows` rows for a step run ahead; StepInput.prev_sampled),
    kv_cache, int32 [E] a mixture of experts' real tokens per expert over the iterations or
    None). It runs max(num_steps) iterations (at most k). `step_fn` is the runner's step
    function (model and fused sampling: extras["sampled"], extras["expert_load"])."""
    def run(params, kv_cache, step: StepInput, plan: PlanArrays):
        r, t = step.seq_lens.shape[0], step.num_tokens
        s = step.sampling

        def body(j, carry):
            kv, ids, out, load = carry
            sj = dataclasses.replace(
                step, input_ids=ids, positions=plan.positions[j], slot_mapping=plan.slot_mapping[j],
                seq_lens=plan.seq_lens[j], rope_cos=plan.rope_cos[j], rope_sin=plan.rope_sin[j],
                prev_sampled=None, prev_index=None,  # the ids are in `ids` (input_ids(step) at 0)
                sampling=smp.SamplingArrays(s.temperature, s.top_p, s.top_k, s.min_p, s.seed,
                                            s.sample_index, s.step + j, s.seed_hi))
            _, kv, extras = step_fn(params, kv, sj)
            tokens = extras["sampled"][:r]
            load = None if load is None else load + extras["expert_load"]
            return kv, jnp.zeros(t, jnp.int32).at[:r].set(tokens), out.at[j].set(tokens), load

        load = jnp.zeros(num_experts, jnp.int32) if num_experts else None
        first = (kv_cache, input_ids(step), jnp.zeros((k, r), jnp.int32), load)
        kv_cache, _, out, load = jax.lax.fori_loop(0, jnp.max(plan.num_steps), body, first)
        last = out[jnp.maximum(plan.num_steps - 1, 0), jnp.arange(r)]
        return MultiOutput(out, smp.pad_rows(last, prev_rows)), kv_cache, load
    return run


def collect(sampler, res, sampled, spans) -> None:
    """Read a step's tokens into RunnerOutput `res`: a SamplerOutput's by RowSampler
    `sampler`; a k-step program's MultiOutput here, each span's sequence
    (jaxkv.sampling.rows.Span: sched, row = its column) getting its num_steps tokens."""
    if not isinstance(sampled, MultiOutput):
        return sampler.collect(res, sampled, spans)
    cols = np.asarray(jax.device_get(sampled.tokens)).T.tolist()
    for x in spans:
        res.sampled[x.sched.request_id] = cols[x.row][:x.sched.num_steps]


class MultiStep:
    """A runner's k-step programs: one per token bucket of decode steps and decode_only,
    compiled with the bucket (`compile`: warmup or the background compiler) or else on first
    use under `compiles`, the runner's CompileCounter. step_fn: the runner's step function;
    k: num_scheduler_steps (> 1); jit: jax.jit, or a plain call with enforce_eager."""

    def __init__(self, step_fn, k: int, block_size: int, rope_table, compiles, prev_rows: int,
                 num_experts: int = 0, jit=jax.jit):
        self.k, self.block_size, self.rope_table, self.compiles = k, block_size, rope_table, compiles
        self.program = jit(program(step_fn, k, prev_rows, num_experts), donate_argnums=(1,))
        self.compiled: dict[tuple[int, bool], object] = {}  # (bucket, decode_only) -> executable
        self.num_steps_run = 0  # engine steps that ran several decode steps (the runner counts)

    def compile(self, params, kv_spec, si: StepInput) -> None:
        """Compile the program of `si`'s bucket and decode_only (abstract params and pool;
        `si` as build_step_input pads an empty step, with fused sampling's arrays)."""
        key = (si.num_tokens, si.decode_only)
        if key not in self.compiled and hasattr(self.program, "lower"):
            plan = plan_arrays(si, np.zeros(0, np.int32), self.k, self.block_size, self.rope_table)
            self.compiled[key] = self.program.lower(params, kv_spec, si, plan).compile()

    @staticmethod
    def wanted(scheduled) -> bool:
        """Whether the scheduler gave some of these ScheduledRequests more than one step."""
        return any(s.num_steps > 1 for s in scheduled)

    @staticmethod
    def parts(scheduled) -> list[list]:
        """The programs a step's ScheduledRequests run as: those given several steps (a
        k-step program) and the others (prompt chunks, sequences that need the host: the
        step program), each part non-empty, in that order."""
        multi = [s for s in scheduled if s.num_steps > 1]
        if not multi or len(multi) == len(scheduled):
            return [scheduled] if scheduled else []
        return [multi, [s for s in scheduled if s.num_steps == 1]]

    def prepare(self, scheduled, si: StepInput):
        """The host side of the decode step of `scheduled` (its StepInput `si`, in a bucket
        with fused sampling; a step run ahead has its prev_sampled and prev_index set): (its
        spans, `si` with their sampling arrays, its PlanArrays), for `call`."""
        spans = fs.spans(scheduled)
        si = fs.with_sampling(si, spans)
        steps = np.fromiter((s.num_steps for s in scheduled), np.int32, len(scheduled))
        return spans, si, plan_arrays(si, steps, self.k, self.block_size, self.rope_table)

    def call(self, params, kv_cache, si: StepInput, plan: PlanArrays):
        """Dispatch the k-step program of a `prepare`d step: (its MultiOutput still on the
        device, the updated pool, the experts' load or None)."""
        with self.compiles:
            exe = self.compiled.get((si.num_tokens, si.decode_only), self.program)
            return exe(params, kv_cache, si, plan)
