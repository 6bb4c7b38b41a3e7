"""Prometheus metrics for GET /metrics, with vLLM's names under the `jaxkv:` prefix
(`--metrics-prefix vllm` gives vLLM's own names, for routers that read them, e.g. the
Kubernetes inference gateway: num_requests_waiting, num_requests_running,
kv_cache_usage_perc, cache_config_info).

Names, meanings and histogram bucket edges follow vLLM's V1 PrometheusStatLogger
(vllm/v1/metrics/loggers.py). Gauges and counters are read from the engine's stats at scrape
time (EngineStats, the same numbers as `LLM.stats()`); histograms and the per-reason success
counter are fed from RequestOutput.metrics on the output thread after every step
(`record(outputs)`). Every series carries the label model_name.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

DEFAULT_PREFIX = "jaxkv"
_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def check_metrics_prefix(prefix: str) -> str:
    """The prefix of every series name (before the colon): a Prometheus name part. ValueError
    naming --metrics-prefix otherwise."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"--metrics-prefix must be letters, digits and underscores, not starting "
                         f"with a digit (e.g. jaxkv or vllm), got {prefix!r}")
    return prefix

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = ITL_BUCKETS  # vllm:request_time_per_output_token_seconds uses the same edges
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)



def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's edges for token-count histograms)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


_GAUGES = (("num_requests_running", "num_running", "Number of requests in model execution batches."),
           ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
           ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
           ("num_free_blocks", "num_free_blocks", "Free KV-cache blocks (cached ones included)."),
           ("num_total_blocks", "num_total_blocks", "Usable KV-cache blocks."),
           ("num_token_buckets", "num_token_buckets", "Token buckets (padded step sizes) configured."),
           ("num_compiled_token_buckets", "num_compiled_token_buckets",
            "Token buckets whose programs are compiled; steps pad to these."))
_COUNTERS = (("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in tokens."),
             ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in tokens."),
             ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
             ("fused_sampling_steps", "num_fused_sampling_steps",
              "Steps whose sampling ran inside the step program (fused sampling)."),
             ("launched_steps", "num_launched_steps",
              "Steps run ahead dispatched from the launcher thread, off the engine thread."),
             ("async_steady_steps", "num_async_steps_steady",
              "Steps run ahead that the steady batch's fast path took (every sequence as predicted)."),
             ("multi_steps", "num_multi_steps",
              "Engine steps that ran several decode steps in one program (multi-step decode)."),
             ("generation_tokens", "num_generation_tokens", "Number of generation tokens processed."),
             ("engine_steps", "num_steps", "Engine steps that ran a batch."),
             ("engine_host_cpu_seconds", "host_cpu_seconds",
              "CPU seconds of the engine thread in its steps (the host's work; waits cost none)."),
             ("engine_output_cpu_seconds", "output_cpu_seconds",
              "CPU seconds of output processing (detokenizing, stop strings, outputs), on its own thread."),
             ("window_freed_blocks", "num_window_freed_blocks",
              "KV blocks freed behind the sliding window (a model whose every layer has one)."),
             ("structured_output_requests", "num_structured_output_requests",
              "Requests (samples) with a structured-output constraint."),
             ("grammar_compile_seconds", "grammar_compile_seconds",
              "Seconds spent building grammar matchers (off the step loop)."),
             ("spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
             ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
              "Number of draft tokens."),
             ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
              "Number of accepted tokens."))


_TIER_COUNTERS = (("hit_tokens", "Prompt tokens found in the tier (not computed again)."),
                  ("stored_blocks", "Blocks copied into the tier."),
                  ("loaded_blocks", "Blocks copied from the tier back to the device."))


def _weights_series(p: str, model_name: str, s):
    """The weights' bytes by format, and a mixture of experts' load imbalance."""
    if s.moe_load_imbalance is not None:
        g = GaugeMetricFamily(f"{p}:moe_load_imbalance", "The busiest expert's tokens over "
                              "the mean, over every step (a mixture of experts).",
                              labels=["model_name"])
        g.add_metric([model_name], float(s.moe_load_imbalance))
        yield g
    g = GaugeMetricFamily(f"{p}:weights_bytes", "Bytes the model's weights hold on the "
                          "devices, by format (quantization none: the model's dtype).",
                          labels=["model_name", "quantization"])
    g.add_metric([model_name, s.quantization or "none"], float(s.weights_bytes))
    yield g


def _tier_series(p: str, model_name: str, s):
    tiers = [t for t in ("host", "disk") if getattr(s, f"kv_offload_{t}_blocks")]
    g = GaugeMetricFamily(f"{p}:kv_offload_usage_perc", "KV offload tier usage. 1 means 100 "
                          "percent usage.", labels=["model_name", "tier"])
    for t in tiers:
        g.add_metric([model_name, t], getattr(s, f"kv_offload_{t}_used_blocks")
                     / getattr(s, f"kv_offload_{t}_blocks"))
    yield g
    for name, doc in _TIER_COUNTERS:
        c = CounterMetricFamily(f"{p}:kv_offload_{name}", doc, labels=["model_name", "tier"])
        for t in tiers:
            c.add_metric([model_name, t], float(getattr(s, f"kv_offload_{t}_{name}")))
        yield c
    c = CounterMetricFamily(f"{p}:num_swapped_out", "Preemptions that swapped a request's "
                            "blocks out to the host tier.", labels=["model_name"])
    c.add_metric([model_name], float(s.num_swapped_out))
    yield c


class _EngineCollector:
    def __init__(self, stats_fn, model_name: str, prefix: str, cache_info: dict | None):
        self.stats_fn, self.model_name, self.prefix = stats_fn, model_name, prefix
        self.cache_info = cache_info

    def collect(self):
        p = self.prefix
        s = self.stats_fn()
        if s is None:
            return
        if self.cache_info is not None:  # an info gauge, value 1, as vLLM's cache_config_info
            info = {**self.cache_info, "num_gpu_blocks": s.num_total_blocks}
            g = GaugeMetricFamily(f"{p}:cache_config_info", "Information of the LLMEngine "
                                  "CacheConfig", labels=list(info))
            g.add_metric([str(v) for v in info.values()], 1.0)
            yield g
        par = {"tensor_parallel_size": s.tensor_parallel_size, "num_processes": s.num_processes}
        g = GaugeMetricFamily(f"{p}:parallel_config_info", "Information of the engine's "
                              "parallel layout (tensor parallelism, processes)", labels=list(par))
        g.add_metric([str(v) for v in par.values()], 1.0)
        yield g
        g = GaugeMetricFamily(f"{p}:attention_backend_info", "Information of the engine's "
                              "attention backend (cpu, xla or pallas) and of the steps whose "
                              "matmuls run through the cpu backend's C++ kernel (at most "
                              "cpu_matmul_max_rows rows; 0: none)",
                              labels=["attention_backend", "cpu_matmul_max_rows"])
        g.add_metric([s.attention_backend, str(s.cpu_matmul_max_rows)], 1.0)
        yield g
        if s.async_scheduling:  # decode steps dispatched ahead, by what became of them
            c = CounterMetricFamily(f"{p}:async_steps", "Decode steps dispatched ahead of the "
                                    "scheduler (async scheduling), by outcome: used (some "
                                    "sequence took the result) or discarded.",
                                    labels=["model_name", "outcome"])
            c.add_metric([self.model_name, "used"], float(s.num_async_steps_used))
            c.add_metric([self.model_name, "discarded"], float(s.num_async_steps_discarded))
            yield c
        if s.kv_offload_host_blocks:  # the KV cache tiers, one series per tier
            yield from _tier_series(p, self.model_name, s)
        for name, field, doc in _GAUGES:
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(s, field)))
            yield g
        yield from _weights_series(p, self.model_name, s)
        spec = bool(s.spec_decode_num_accepted_tokens_per_pos)  # speculative decoding is on
        for name, field, doc in _COUNTERS:
            if name.startswith("spec_decode") and not spec:
                continue  # as vLLM: the spec_decode series exist only when it is on
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(s, field)))
            yield c
        if spec:
            c = CounterMetricFamily(f"{p}:spec_decode_num_accepted_tokens_per_pos", "Accepted "
                                    "tokens per draft position.", labels=["model_name", "position"])
            for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                c.add_metric([self.model_name, str(pos)], float(n))
            yield c


def cache_config_info(args) -> dict:
    """The static labels of cache_config_info from EngineArgs (vLLM's CacheConfig fields that
    jaxkv has). num_gpu_blocks (the usable blocks, what a router reads with block_size) is
    added from the engine's stats at every scrape."""
    return {"block_size": args.block_size, "cache_dtype": args.kv_cache_dtype,
            "enable_prefix_caching": args.enable_prefix_caching,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "num_gpu_blocks_override": args.num_gpu_blocks_override}


class PrometheusStatLogger:
    """`registry` holds every series; `stats_fn()` returns the current EngineStats (or None
    before the engine exists). `record(outputs)` is the AsyncLLM stat-logger hook.
    prefix: the series names' prefix (check_metrics_prefix). cache_info: the labels of the
    `<prefix>:cache_config_info` gauge (cache_config_info(...)), or None for no such series."""

    def __init__(self, stats_fn, model_name: str, max_model_len: int = 8192, *,
                 prefix: str = DEFAULT_PREFIX, cache_info: dict | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        p = self.prefix = check_metrics_prefix(prefix)
        self.registry.register(_EngineCollector(stats_fn, model_name, p, cache_info))
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets):
            return Histogram(f"{p}:{name}", doc, buckets=buckets, labelnames=labels,
                             registry=self.registry).labels(model_name)
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in "
                         "seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in "
                        "seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency "
                        "in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Histogram of time spent waiting before "
                          "the first step of a request, in seconds.", REQUEST_LATENCY_BUCKETS)
        tokens = build_1_2_5_buckets(max_model_len)
        self.req_prompt = hist("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_generation = hist("request_generation_tokens", "Number of generation tokens "
                                   "processed.", tokens)
        self.tpot = hist("request_time_per_output_token_seconds", "Histogram of "
                         "time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.success = Counter(f"{p}:request_success", "Count of finished requests, by "
                               "finish reason.", labelnames=["model_name", "finished_reason"],
                               registry=self.registry)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Number of prefill tokens processed "
                                     "(counted when a request's prefill is done).",
                                     labelnames=labels, registry=self.registry).labels(model_name)
        self._last_token: dict[str, float] = {}
        self._counted: dict[str, set[int]] = {}

    def record(self, outputs) -> None:
        for o in outputs:
            m = o.metrics
            if m is None:
                continue
            last = self._last_token.get(o.request_id)
            if last is None and m.first_token_time is not None:  # prefill done (vLLM counts then)
                self.prompt_tokens.inc(len(o.prompt_token_ids))
                self.ttft.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.queue.observe(m.first_scheduled_time - m.arrival_time)
            elif last is not None and m.last_token_time is not None and m.last_token_time > last:
                self.itl.observe(m.last_token_time - last)
            if m.last_token_time is not None:
                self._last_token[o.request_id] = m.last_token_time
            done = self._counted.setdefault(o.request_id, set())
            for c in o.outputs:  # each sample once, whatever the output kind
                if c.finish_reason is not None and c.index not in done:
                    done.add(c.index)
                    self.success.labels(self.model_name, c.finish_reason).inc()
            if o.finished:
                self._last_token.pop(o.request_id, None)
                self._counted.pop(o.request_id, None)
                if m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)
            for _, n, t_first, t_last in m.finished_samples:  # per sample, as vLLM per request
                self.req_prompt.observe(len(o.prompt_token_ids))
                self.req_generation.observe(n)
                # Mean time per output token after the first (0 with a single token).
                ok = n > 1 and t_first is not None and t_last is not None
                self.tpot.observe((t_last - t_first) / (n - 1) if ok else 0.0)
