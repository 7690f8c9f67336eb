"""Prometheus metrics (`GET /metrics`): radixlm's own under `radixlm:`, plus the names gateways read.

Gateways and dashboards built for other engines read those engines' names, so the load gauges are
exported under them too (same values, `model_name` label, see `ALIASES`): SGLang's
`sglang:num_running_reqs`, `num_queue_reqs`, `token_usage`, `cache_hit_rate`, `gen_throughput`
(SGLang's Model Gateway, its dashboards), and vLLM's `vllm:num_requests_running`,
`num_requests_waiting`, `kv_cache_usage_perc` and the older `gpu_cache_usage_perc` (the Gateway API
inference extension's endpoint picker, llm-d, KServe read these by default), plus the info gauge
`vllm:cache_config_info{block_size, num_gpu_blocks}`.

The TokenizerManager calls the per-request hooks (`observe_ttft`, `observe_itl`,
`on_request_finished`) and feeds each `SchedulerStats` push to `update_scheduler_stats`.
Scheduler stats carry cumulative counters (prefix-cache queries/hits, preemptions); this class
turns them into Prometheus counter increments by remembering the last value per DP rank.

Each collector owns a private CollectorRegistry, so several servers or engines in one process
(tests) never clash over metric names.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from .managers.io_struct import SchedulerStats

PREFIX = "radixlm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# cumulative SchedulerStats field -> counter attribute on MetricsCollector
_CUMULATIVE_FIELDS = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "late_divergence_misses": "late_divergence_misses",
    "spec_verify_ct": "spec_verify_ct",
    "spec_draft_tokens": "spec_draft_tokens",
    "spec_accepted_tokens": "spec_accepted_tokens",
}


# alias name -> the radixlm gauge attribute it mirrors (every alias is a Gauge with `model_name`)
ALIASES = {
    "sglang:num_running_reqs": "num_requests_running",
    "sglang:num_queue_reqs": "num_requests_waiting",
    "sglang:token_usage": "kv_cache_usage",
    "sglang:cache_hit_rate": "cache_hit_rate",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:max_total_num_tokens": "max_total_tokens",
    "sglang:spec_accept_length": "spec_accept_length",
    "sglang:spec_accept_rate": "spec_accept_rate",
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",
}


class MetricsCollector:
    """Owns the gauges, counters and histograms of one server. Thread-safe."""

    def __init__(self, model_name: str = "default", page_size: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.page_size = page_size
        self._lock = threading.Lock()
        self._last_cumulative: dict[int, dict[str, int]] = {}   # dp_rank -> field -> last value
        self._rank_gauges: dict[int, SchedulerStats] = {}        # dp_rank -> latest stats
        self._make_gauges()
        self._make_counters()
        self._make_histograms()
        self._aliases = self._make_aliases()
        self._cache_config = Gauge("vllm:cache_config_info", "KV cache layout (value 1; the labels carry it).",
                                   ["block_size", "num_gpu_blocks"], registry=self.registry)
        self._cache_config_labels: tuple[str, str] | None = None

    # ------------------------------------------------------------------ construction
    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _make_gauges(self) -> None:
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = self._gauge(
            "kv_cache_usage", "Fraction of KV slots held by requests (0-1), the evictable cache excluded.")
        self.radix_cache_tokens = self._gauge("radix_cache_tokens", "Tokens in the evictable prefix cache.")
        self.max_total_tokens = self._gauge("max_total_tokens", "KV pool size in tokens.")
        self.gen_throughput = self._gauge("gen_throughput", "Generation throughput (tokens/s) of the last stats.")
        self.cache_hit_rate = self._gauge(
            "cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.")
        self.spec_accept_length = self._gauge(
            "spec_accept_length", "Speculative decoding: tokens per verify pass (accepted proposals + 1), since start.")
        self.spec_accept_rate = self._gauge(
            "spec_accept_rate", "Speculative decoding: accepted / verified proposals, since start.")

    def _make_aliases(self) -> dict[str, list[Gauge]]:
        """One Gauge per name in ALIASES; returns radixlm attribute -> its alias gauges."""
        out: dict[str, list[Gauge]] = {}
        for name, attr in ALIASES.items():
            doc = f"Same as {PREFIX}{attr} (the name other engines' gateways and dashboards read)."
            gauge = Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)
            out.setdefault(attr, []).append(gauge)
        return out

    def _set(self, attr: str, value: float) -> None:
        """Sets the radixlm gauge `attr` and every alias of it."""
        getattr(self, attr).set(value)
        for gauge in self._aliases.get(attr, ()):
            gauge.set(value)

    def _make_counters(self) -> None:
        self.prefix_cache_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.prefix_cache_hits = self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated by finished requests.")
        self.num_preemptions = self._counter("num_preemptions", "Requests retracted to free KV.")
        self.num_aborted_requests = self._counter("num_aborted_requests", "Requests aborted (disconnect, abort).")
        self.num_finished_requests = self._counter("num_finished_requests", "Requests that finished.")
        self.late_divergence_misses = self._counter(
            "prefix_cache_late_divergence_misses", "Prefix-cache misses where a match diverged late.")
        self.spec_verify_ct = self._counter("spec_verify_ct", "Speculative verify passes (one per request).")
        self.spec_draft_tokens = self._counter("spec_draft_tokens", "Speculative proposals verified.")
        self.spec_accepted_tokens = self._counter("spec_accepted_tokens", "Speculative proposals accepted.")

    def _make_histograms(self) -> None:
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Time from arrival to the first output token.", TTFT_BUCKETS)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)

    # ------------------------------------------------------------------ hooks (TokenizerManager)
    def observe_ttft(self, seconds: float) -> None:
        self.time_to_first_token.observe(max(0.0, seconds))

    def observe_itl(self, seconds: float) -> None:
        self.inter_token_latency.observe(max(0.0, seconds))

    def on_request_finished(self, prompt_tokens: int, completion_tokens: int, e2e_seconds: float,
                            aborted: bool) -> None:
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, completion_tokens))
        self.e2e_request_latency.observe(max(0.0, e2e_seconds))
        self.num_finished_requests.inc()
        if aborted:
            self.num_aborted_requests.inc()

    def update_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Sets the gauges and adds the growth of the cumulative counters since the last push.

        A counter that went down (the scheduler restarted its count) is taken as a fresh start.
        """
        with self._lock:
            self._rank_gauges[stats.dp_rank] = stats
            last = self._last_cumulative.setdefault(stats.dp_rank, {})
            for field, attr in _CUMULATIVE_FIELDS.items():
                value = int(getattr(stats, field, 0) or 0)
                previous = last.get(field, 0)
                delta = value - previous if value >= previous else value
                if delta > 0:
                    getattr(self, attr).inc(delta)
                last[field] = value
            self._set_gauges(list(self._rank_gauges.values()))

    def _set_gauges(self, ranks: list[SchedulerStats]) -> None:
        total = sum(s.max_total_tokens for s in ranks)
        used = sum(s.kv_used_tokens for s in ranks)
        self._set("num_requests_running", sum(s.num_running_reqs for s in ranks))
        self._set("num_requests_waiting", sum(s.num_waiting_reqs + s.num_grammar_queue_reqs for s in ranks))
        self._set("kv_cache_usage", used / total if total > 0 else 0.0)
        self.radix_cache_tokens.set(sum(s.kv_evictable_tokens for s in ranks))
        self.set_max_total_tokens(total)
        self._set("gen_throughput", sum(s.gen_throughput for s in ranks))
        queries = sum(last.get("prefix_cache_queries", 0) for last in self._last_cumulative.values())
        hits = sum(last.get("prefix_cache_hits", 0) for last in self._last_cumulative.values())
        self._set("cache_hit_rate", hits / queries if queries > 0 else 0.0)
        verify, drafted, accepted = (sum(last.get(k, 0) for last in self._last_cumulative.values())
                                     for k in ("spec_verify_ct", "spec_draft_tokens", "spec_accepted_tokens"))
        self._set("spec_accept_length", (accepted + verify) / verify if verify > 0 else 0.0)
        self._set("spec_accept_rate", accepted / drafted if drafted > 0 else 0.0)

    # ------------------------------------------------------------------ export
    def set_max_total_tokens(self, value: int) -> None:
        """Known from the scheduler's handshake before the first stats push. Also sets
        `vllm:cache_config_info` (blocks of `page_size` tokens)."""
        self._set("max_total_tokens", value)
        labels = (str(self.page_size), str(value // max(self.page_size, 1)))
        if labels != self._cache_config_labels:
            self._cache_config.clear()
            self._cache_config.labels(*labels).set(1)
            self._cache_config_labels = labels

    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
