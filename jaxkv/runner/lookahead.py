"""Async scheduling (vLLM's `async_scheduling`): the next decode step dispatched before this
step's sampled tokens reach the host (host side: numpy and plain data, no JAX).

After dispatching a step whose every sequence samples a token, the runner predicts the next
step: each of those sequences decoding that token at the next position, in the same order, as
the scheduler will schedule it unless something changes (`plan`). The prediction runs at once:
its input ids are taken on the device from the step's sampled tokens (StepInput.prev_sampled
and prev_index: each sampler output is padded to max_num_seqs rows, so any rows of up to two
outputs feed any token bucket), so the device goes from one step to the next while the host
reads the tokens, updates the requests, detokenizes, checks stops and schedules. When the
scheduler's next step arrives, each of its sequences that equals its prediction (same
position, token, blocks and sampling inputs) takes the result computed ahead; the others (a
new prompt admitted meanwhile, as vLLM's async scheduler admits it into the next step; a
sequence that changed) run beside it as a program of their own, and the step after is again
predicted from both outputs. A sequence that stopped meanwhile (EOS, a stop string, an abort)
simply is not asked for: its row is dropped, and the one K/V row written ahead lands in its
own last, partial block, which no hash covers and which is written again before anyone reads
that position (or, if the block went to another request, before that request reads it: the
step run ahead precedes every later program on the device).

A sequence is predicted only where the next step's inputs do not depend on this step's token
on the host: no bad_words, no grammar, no drafts (speculative decoding), no prompt logprobs;
its next position must lie in a block it already holds. The penalties that read the token
history (repetition, presence, frequency) are predicted too: their history is the host's
but for its last token, which the sampler takes on the device from this step's sampled
tokens (RowSampler.dispatch's pending, sampler.with_pending). One that ends by length now
(max_tokens, max_model_len) is left out of the prediction, and so is a prompt chunk that
samples nothing (a prompt longer than the step's token budget): the scheduler's next step
asks its next chunk, which runs beside the step run ahead as a program of its own, as an
arrival does. A step is run ahead when each sequence that sampled is predicted or ends by
length: not from a step after which some sequence's next token needs a new block that its
lookahead slot did not give it, nor while a sequence that samples has bad_words, a grammar,
drafts or prompt logprobs (a chunk before a prompt's last one, prompt logprobs or not, samples
nothing).

Multi-step decode (jaxkv/runner/multi_step.py, num_scheduler_steps k > 1) is predicted the
same way: each sequence goes on from its last sampled token at the position after its last
step, with the steps the scheduler will give it (`multi_steps`); its lookahead slots are k,
so those positions lie in blocks it holds. A step that mixes plain decodes with sequences
that need the host (logprobs, say) runs two programs and is not run ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxkv.core.scheduler_output import ScheduledRequest


@dataclass
class Ahead:
    """A step dispatched ahead: `predicted` (ScheduledRequests; token_ids filled with the
    sampled tokens once they reach the host), `spans` (their sampler rows), `sampled` (the
    sampler's device output) and `batch` (a plain decode's rows as arrays, the fast path of
    jaxkv/runner/steady_batch.py, or None). A step the fast path dispatched has only its
    batch: `predicted` and `spans` None until the general path needs them (RunAhead)."""
    predicted: list[ScheduledRequest] | None
    spans: list | None
    sampled: object
    batch: object = None

    def fill_tokens(self, sampled: dict[str, list[int]]) -> None:
        """Set each predicted sequence's input token: the one this step sampled for it (a
        batch made without its predictions, SteadyBatch.joined: each of its rows')."""
        if self.predicted is None:
            self.batch.tokens = tuple([int(sampled[rid][-1])] for rid in self.batch.ids)
            return
        for q in self.predicted:
            q.token_ids = [int(sampled[q.request_id][-1])]
        if self.batch is not None:
            self.batch.tokens = tuple(q.token_ids for q in self.predicted)

    def split(self, scheduled: list[ScheduledRequest]) -> tuple[list, list[ScheduledRequest]]:
        """([(ScheduledRequest, its span here)] computed ahead, [ScheduledRequest] to run)."""
        by_id = {q.request_id: i for i, q in enumerate(self.predicted)}
        reuse, rest = [], []
        for s in scheduled:
            i = by_id.get(s.request_id)
            if i is not None and same_step(s, self.predicted[i]):
                reuse.append((s, self.spans[i]))
            else:
                rest.append(s)
        return reuse, rest


def _host_free(s: ScheduledRequest) -> bool:
    """Whether `s` samples (one token, or one per step of a multi-step decode) and its next
    step's inputs do not depend on those tokens on the host (no bad_words, grammar, drafts
    or prompt logprobs; the penalties' token history takes its last token on the device)."""
    p = s.sampling_params
    return (s.sample and not s.spec_token_ids and s.grammar_bitmask is None
            and not s.prompt_logprob_targets and getattr(p, "structured_outputs", None) is None
            and not getattr(p, "bad_words", None))


def same_step(s: ScheduledRequest, q: ScheduledRequest) -> bool:
    """Whether the scheduler's `s` asks exactly what the prediction `q` computed (the cheap
    comparisons first: this runs per sequence per step). A penalty's token history is the
    request's own list (Scheduler._describe hands it over, not a copy), which only grows
    while the request runs (Request.truncate_output cuts it only as the request finishes):
    the same list with num_output_tokens equal holds the history q's sampler read, the last
    token being the one it took on the device."""
    return (s.num_computed_tokens == q.num_computed_tokens and s.token_ids == q.token_ids
            and s.sampling_params is q.sampling_params and s.request_id == q.request_id
            and s.num_output_tokens == q.num_output_tokens and s.num_steps == q.num_steps
            and s.seed == q.seed and s.sample_index == q.sample_index
            and s.min_tokens_banned_ids == q.min_tokens_banned_ids and _host_free(s)
            and s.output_token_ids is q.output_token_ids and s.prompt_token_ids is q.prompt_token_ids
            and same_blocks(s.block_ids, q.block_ids))


def same_blocks(now: list[int], predicted: list[int]) -> bool:
    """Whether the block tables agree where the prediction read and wrote: the scheduler's
    may have grown since (blocks appended past them: a lookahead slot) or freed blocks behind
    a sliding window (now the null block 0: the prediction's query masked those positions)."""
    if now[:len(predicted)] == predicted:  # (the usual case, compared at once)
        return True
    return len(now) >= len(predicted) and all(a == b or a == 0 for a, b in zip(now, predicted))


def plan(scheduled: list[ScheduledRequest], sources: dict[str, tuple[int, int]], block_size: int,
         max_model_len: int, rows: int, k: int = 1) -> tuple[list[ScheduledRequest], list[int]] | None:
    """The step to run ahead after a step of `scheduled` whose sampled tokens lie on the
    device: `sources` maps each sequence that sampled to (its sampler output 0 or 1, its row
    there), each output padded to `rows` rows. Returns (the predicted ScheduledRequests, for
    each its input token's index in the two outputs concatenated), leaving out sequences
    that end by length now and prompt chunks that sample nothing (the scheduler's next step
    asks their next chunk, which runs as a program beside the step run ahead); None when a
    sampling sequence's next step cannot be predicted, or none goes on. With multi-step decode (`k` =
    num_scheduler_steps > 1) the steps of each predicted sequence are those the scheduler will
    give it (`multi_steps`)."""
    predicted, index = [], []
    for s in scheduled:
        src = sources.get(s.request_id)
        if src is None:
            if s.sample:  # (its tokens lie in a third output: not predicted)
                return None
            continue  # a prompt chunk: its next chunk runs beside the step run ahead
        q = predict(s, block_size, max_model_len)
        if q is None:
            if ends_by_length(s, max_model_len):
                continue  # finished by update_from_output: never asked again
            return None
        predicted.append(q)
        index.append(src[0] * rows + src[1])
    if k > 1 and predicted and not multi_steps(predicted, block_size, max_model_len, k):
        return None
    return (predicted, index) if predicted else None


def multi_steps(predicted: list[ScheduledRequest], block_size: int, max_model_len: int, k: int) -> bool:
    """Set each predicted sequence's num_steps as jaxkv.core.multi_step.multi_steps will (a
    plain decode: up to k within max_tokens and max_model_len). False when some sequence's
    steps reach past the blocks it holds (the scheduler would allocate, so the prediction
    would not hold), or when plain and other sequences are mixed (two programs: such a step
    is not run ahead); True with every num_steps 1 when none is plain."""
    plain = [_plain(q) for q in predicted]
    if not any(plain):
        return True
    if not all(plain):
        return False
    for q in predicted:
        q.num_steps = max(1, min(k, q.sampling_params.max_tokens - q.num_output_tokens,
                                 max_model_len - q.num_computed_tokens - 1))
        if (q.num_computed_tokens + q.num_steps - 1) // block_size >= len(q.block_ids):
            return False
    return True


def _plain(q: ScheduledRequest) -> bool:
    """jaxkv.core.multi_step.plain_decode of the sequence `q` predicts (its host-free checks
    already passed): no logprobs, penalties, logits filters or min_tokens ban."""
    p = q.sampling_params
    return (p.logprobs is None and not p.has_penalties and not p.has_logits_filters
            and q.num_output_tokens >= p.min_tokens)


def ends_by_length(s: ScheduledRequest, max_model_len: int) -> bool:
    """Whether the token `s` samples now surely ends it (max_tokens, max_model_len: the
    scheduler's length finish, whatever the token is)."""
    pos = s.num_computed_tokens + s.num_scheduled_tokens + s.num_steps - 1
    return (s.sample and not s.spec_token_ids
            and (s.num_output_tokens + s.num_steps >= s.sampling_params.max_tokens or pos + 1 >= max_model_len))


def predict(s: ScheduledRequest, block_size: int, max_model_len: int) -> ScheduledRequest | None:
    """The next step of a sequence that samples one token now, if the scheduler will ask it
    as predicted when it goes on (None when it cannot be predicted or surely stops): one
    token (placeholder 0 until the sampled one is known) at the next position."""
    if not _host_free(s):
        return None
    pos = s.num_computed_tokens + s.num_scheduled_tokens + s.num_steps - 1
    out = s.num_output_tokens + s.num_steps
    if (pos // block_size >= len(s.block_ids) or pos + 1 >= max_model_len
            or out >= s.sampling_params.max_tokens):
        return None
    q = object.__new__(ScheduledRequest)  # a copy of s (dataclasses.replace runs __init__:
    q.__dict__.update(s.__dict__)  # several times slower, and this runs per sequence per step)
    q.token_ids, q.num_computed_tokens, q.num_output_tokens, q.num_steps = [0], pos, out, 1
    if out >= s.sampling_params.min_tokens:
        q.min_tokens_banned_ids = []
    return q
