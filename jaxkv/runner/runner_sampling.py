"""The sampler's side of ModelRunner: the sampled rows' logits and sampling in jitted programs of
their own (jaxkv/runner/sampler.py), dispatched after the step and read back to the host.

A mixin of ModelRunner (jaxkv/runner/model_runner.py), which holds the state these use: the
params, `programs` (jaxkv/runner/compiler.py's Programs: the jitted gather, sample and prompt
logprobs functions), `_logits`, and the sizes
(max_num_seqs, num_speculative_tokens, vocab_size, max_model_len, max_logprobs).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.runner import sampler as smp
from jaxkv.runner import sampling_rows as rows
from jaxkv.runner.buckets import num_rows, pow2_at_least


class RunnerSampling:
    # ---- jitted bodies ------------------------------------------------------------------
    def _sample_rows(self, params, hidden_rows, s, pen, bitmask, *, mode, num_logprobs):
        logits = self._logits(params, hidden_rows)
        return smp.sample(logits, s, pen, bitmask, mode=mode, num_logprobs=num_logprobs,
                          cpu=self.model.cpu_matmul)

    def _prompt_logprobs(self, params, hidden, targets, *, num_logprobs):
        return smp.prompt_logprobs(self._logits(params, hidden), targets, num_logprobs=num_logprobs)

    # ---- host side ----------------------------------------------------------------------
    def sample_rows(self, t: int, n: int = 0) -> int:
        """Sampler rows of a token-bucket-t step that samples n rows: min(t, max_num_seqs),
        every sequence's last row; more only with draft rows (speculative decoding): the next
        power of two, at most t."""
        r = num_rows(t, self.max_num_seqs)
        return r if n <= r else min(t, pow2_at_least(n, 1))

    def sample_row_counts(self, t: int) -> tuple[int, ...]:
        """Every sampler row count a token-bucket-t step can use (compiled with the bucket)."""
        most = min(t, self.max_num_seqs * (1 + self.num_speculative_tokens))
        return tuple(sorted({self.sample_rows(t, n) for n in (0, *range(1, most + 1))}))

    def _dispatch_sample(self, hidden, spans, idx, t):
        """Dispatch the sampling of rows `idx` of `hidden` (a bucket-t step's; `spans` their
        sequences); returns the sampler's output, still on the device."""
        sp = [x.sched.sampling_params for x in spans]
        greedy = all(p.temperature < smp.GREEDY_EPS for p in sp)
        filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in sp if p.temperature >= smp.GREEDY_EPS)
        mode = "greedy" if greedy else ("filtered" if filtered else "random")
        want_lp = any(p.logprobs is not None for p in sp)
        r = self.sample_rows(t, len(idx))
        s_arr = rows.sampling_arrays(spans, r)
        pen = (rows.penalty_arrays(spans, r, self.vocab_size, self.max_model_len)
               if any(rows.needs_penalties(x.sched) for x in spans) else None)
        h = self.programs.gather_rows(hidden, np.pad(idx, (0, r - len(idx))))
        return self.programs.sample(self.params, h, s_arr, pen, rows.grammar_bitmask(spans, r, self.vocab_size),
                            mode=mode, num_logprobs=max(1, self.max_logprobs) if want_lp else 0)

    def _collect_sample(self, res, sampled, spans):
        """Read the sampler's output to the host: each span's kept tokens (and logprobs)."""
        if any(x.sched.sampling_params.logprobs is not None for x in spans):
            o = jax.device_get(sampled)
        else:  # the tokens only (one transfer, not five)
            o = smp.SamplerOutput(jax.device_get(sampled.token_ids), None, None, None, None)
        for x in spans:
            s, ys = x.sched, o.token_ids[x.row:x.row + x.count]
            keep = rows.num_accepted(ys, s.spec_token_ids) + 1
            res.sampled[s.request_id] = [int(y) for y in ys[:keep]]
            if s.sampling_params.logprobs is not None:
                k = s.sampling_params.logprobs
                res.logprobs[s.request_id] = [
                    (float(o.logprob[i]), int(o.rank[i]), o.top_logprobs[i, :k], o.top_ids[i, :k])
                    for i in range(x.row, x.row + keep)]

    def _prompt_logprobs_into(self, res, hidden, qsl, out, t):
        targets = np.zeros(t, np.int32)
        for i, s in enumerate(out.scheduled):
            n = len(s.prompt_logprob_targets)
            targets[qsl[i]:qsl[i] + n] = s.prompt_logprob_targets
        o = jax.device_get(self.programs.prompt_logprobs(self.params, hidden, targets,
                                           num_logprobs=max(1, self.max_logprobs)))
        for i, s in enumerate(out.scheduled):
            n, k = len(s.prompt_logprob_targets), s.sampling_params.prompt_logprobs
            if n:
                sl = slice(qsl[i], qsl[i] + n)
                res.prompt_logprobs[s.request_id] = (o[0][sl], o[1][sl], o[2][sl, :k], o[3][sl, :k])
