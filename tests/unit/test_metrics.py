"""MetricsCollector: the SGLang and vLLM names gateways read carry the same values as radixlm's own."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from radixlm.runtime.managers.io_struct import SchedulerStats
from radixlm.runtime.metrics import ALIASES, MetricsCollector


def _families(collector: MetricsCollector) -> dict[str, tuple[str, list]]:
    """name -> (type, samples) of the rendered exposition text."""
    text = collector.render().decode()
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(text)}


def _stats(**kw) -> SchedulerStats:
    base = dict(num_running_reqs=3, num_waiting_reqs=2, num_grammar_queue_reqs=1, kv_used_tokens=250,
                kv_evictable_tokens=100, max_total_tokens=1000, num_preemptions=0, prefix_cache_queries=400,
                prefix_cache_hits=100, gen_throughput=12.5, spec_verify_ct=10, spec_draft_tokens=40,
                spec_accepted_tokens=15)
    return SchedulerStats(**{**base, **kw})


def test_aliases_are_gauges_with_the_model_name_and_radixlm_values():
    m = MetricsCollector("my-model", page_size=4)
    m.set_max_total_tokens(1000)
    m.update_scheduler_stats(_stats())
    fams = _families(m)
    expected = {"num_requests_running": 3, "num_requests_waiting": 3, "kv_cache_usage": 0.25,
                "cache_hit_rate": 0.25, "gen_throughput": 12.5, "max_total_tokens": 1000,
                "spec_accept_length": 2.5, "spec_accept_rate": 0.375}
    for attr, value in expected.items():
        kind, samples = fams["radixlm:" + attr]
        assert kind == "gauge" and [s.value for s in samples] == [value], attr
    for name, attr in ALIASES.items():
        kind, samples = fams[name]
        assert kind == "gauge", name
        assert [(s.labels, s.value) for s in samples] == [({"model_name": "my-model"}, expected[attr])], name
    _, info = fams["vllm:cache_config_info"]
    assert [(s.labels, s.value) for s in info] == [({"block_size": "4", "num_gpu_blocks": "250"}, 1.0)]


def test_cache_hit_rate_sums_dp_ranks_cumulatively():
    m = MetricsCollector()
    m.update_scheduler_stats(_stats(dp_rank=0, prefix_cache_queries=100, prefix_cache_hits=90))
    m.update_scheduler_stats(_stats(dp_rank=1, prefix_cache_queries=300, prefix_cache_hits=10))
    fams = _families(m)
    assert fams["sglang:cache_hit_rate"][1][0].value == 100 / 400
    assert fams["radixlm:prefix_cache_hits"][1][0].value == 100      # the counter still counts both
    assert fams["sglang:num_running_reqs"][1][0].value == 6          # summed over the ranks
