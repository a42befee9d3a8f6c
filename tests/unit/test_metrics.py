"""The NIM-named metrics: what a request's end records, as Prometheus exposes it."""

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import TPOT_BUCKETS, observe_each, observe_one


def test_observing_a_streams_gaps_at_once_or_by_bisection_exposes_what_observing_each_does():
    """Bounds themselves (a gap on a bucket's edge belongs to it), gaps past the last bound (+Inf),
    zero, and an empty stream; sums as well as buckets."""
    rng = random.Random(7)
    streams = [[rng.uniform(0, 0.3) for _ in range(63)], list(TPOT_BUCKETS), [0.0, 81.0, 1e6], [], [0.01] * 5]
    registries = CollectorRegistry(), CollectorRegistry()
    one_by_one, at_once = (Histogram("time_per_output_token_seconds", "gaps", ["model_name"], buckets=TPOT_BUCKETS,
                                     registry=registry) for registry in registries)
    for i, gaps in enumerate(streams):
        for gap in gaps:
            one_by_one.labels("m").observe(gap)
        if i % 2:  # one value at a time too, as a request's TTFT and latency are
            for gap in gaps:
                observe_one(at_once.labels("m"), gap)
        else:
            observe_each(at_once.labels("m"), gaps)
    exposed = [generate_latest(registry).decode().splitlines() for registry in registries]
    assert [line for line in exposed[0] if "_created" not in line] == [line for line in exposed[1] if "_created" not in line]
    assert 'time_per_output_token_seconds_count{model_name="m"} 90.0' in exposed[1]
