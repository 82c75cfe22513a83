"""`observe_many`: the same exposition as one `observe()` per value, for plain and vLLM-named
(model-labelled) histograms."""

from services.common.metrics import Metrics, observe_many


def _exposition(metrics: Metrics) -> str:
    return "\n".join(
        line for line in metrics.render().decode().splitlines() if "_created" not in line
    )


def test_observe_many_equals_observe_one_by_one():
    values = [0.0, 0.001, 0.0011, 0.004, 0.004, 0.05, 0.3, 7.5, 500.0, 0.0049999]
    one, many = Metrics(model_name="m"), Metrics(model_name="m")
    for metrics in (one, many):
        metrics.plain = metrics.histogram("plain_seconds", "d")
        metrics.named = metrics.histogram("named_seconds", "d", vllm=True)
    for v in values:
        one.plain.observe(v)
        one.named.observe(v)
    observe_many(many.plain, values)
    observe_many(many.named, values[:4])
    observe_many(many.named, values[4:])
    observe_many(many.named, [])
    assert _exposition(many) == _exposition(one)
    assert 'named_seconds_bucket{le="0.005",model_name="m"} 6.0' in _exposition(many)
