"""The records of one step between the scheduler and the runner (plain data, no arrays
needed by the scheduler): SchedulerOutput goes to the runner, RunnerOutput comes back, and
Scheduler.update_from_output turns them into EngineCoreOutputs (jaxkv/core/core_output.py).

The runner never sees a Request: it gets ids, token ids, positions and block ids here, and
hands back the new tokens of each sampled sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScheduledRequest:
    """One sequence's share of a step.

    token_ids: the num_scheduled_tokens token ids computed this step, at positions
    num_computed_tokens .. num_computed_tokens + num_scheduled_tokens - 1.
    block_ids: the sequence's whole block table (physical block ids, logical order).
    sample: whether this step reaches the end of the sequence's known tokens, so its last
    row's logits are sampled. sampling_params/seed/sample_index/num_output_tokens/history feed
    the sampler; prompt_logprob_targets are the next-token ids whose prompt logprobs this
    chunk yields (empty when not asked). spec_token_ids: the draft tokens (speculative
    decoding), the last len(spec_token_ids) of token_ids; the runner samples each of the
    1 + len(spec_token_ids) last positions. grammar_bitmask: a constrained sequence's allowed
    next tokens (bit t % 32 of word t // 32), set only when it samples. num_steps: decode
    steps this engine step runs for the sequence (multi-step decode, jaxkv/runner/multi_step.py:
    one token scheduled, num_steps positions computed and sampled from it on); else 1.
    """
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: Any
    seed: int
    sample_index: int
    num_output_tokens: int
    prompt_token_ids: list[int] | None = None  # only when penalties need them: the
    output_token_ids: list[int] | None = None   # request's own lists (Scheduler._describe)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    min_tokens_banned_ids: list[int] = field(default_factory=list)  # EOS + stop_token_ids
    spec_token_ids: list[int] = field(default_factory=list)
    grammar_bitmask: Any = None  # structured outputs: int32 [ceil(V / 32)] allowed tokens
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # sampling_params.bad_words
    num_steps: int = 1

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class KVTransfers:
    """The block copies of one step between the KV tiers, which the runner makes before the
    step, in this order: device_to_host (blocks evicted from the device pool or swapped out;
    a device block evicted and reused by the same step is saved before it is written), then
    host_to_disk (those new host entries written through to their files), then
    host_to_device and disk_to_device (prefix hits in the lower tiers, into newly allocated
    device blocks). No slot or file is both written and read by one step. Host slots index
    the runner's host arrays; file names are block hashes in hex (jaxkv/core/disk_tier.py)."""
    device_to_host: list[tuple[int, int]] = field(default_factory=list)  # (block id, slot)
    host_to_disk: list[tuple[int, str]] = field(default_factory=list)    # (slot, file name)
    host_to_device: list[tuple[int, int]] = field(default_factory=list)  # (slot, block id)
    disk_to_device: list[tuple[str, int]] = field(default_factory=list)  # (file name, block id)

    def __bool__(self) -> bool:
        return bool(self.host_to_disk or self.device_to_host or self.host_to_device
                    or self.disk_to_device)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    kv_transfers: KVTransfers | None = None  # None or empty: no copy between KV tiers

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


@dataclass
class RunnerOutput:
    """Per sampled request: its new token ids (one, or with a draft the accepted drafts and
    one sampled token), and logprob data per token when asked; prompt logprobs per chunk."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # request id -> per new token: (sampled logprob, rank, top logprobs [k], top ids [k])
    logprobs: dict[str, list[tuple]] = field(default_factory=dict)
    # request id -> (target logprobs [n], ranks [n], top logprobs [n, k], top ids [n, k])
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)
