"""schemathesis against /openapi.json: >= 500 generated requests (valid and invalid), no 5xx.

The gateway is backed by the real scheduler and executor with a tiny random-weight model and
a short maximum model length, so the valid requests that reach generation finish quickly.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from lab.gateway.testing import inprocess_stack

EXAMPLES_PER_MODE = 130  # x 2 modes x 3 POST operations, plus the GET and DELETE operations


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from lab.executor.tiny import make_tiny_model

    run_dir = tmp_path_factory.mktemp("gw-fuzz")
    model = make_tiny_model(run_dir / "tiny")
    with inprocess_stack(
        run_dir, model, executor_kw={"max_model_len": 64}, request_timeout_s=60
    ) as stack:
        yield stack["url"]


def test_generated_requests_never_get_a_5xx(url):
    assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 64
    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json").json())
    statuses: Counter = Counter()
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run_operation(operation, mode, url, statuses, failures)
    total = sum(statuses.values())
    print(f"{total} cases:", dict(statuses))
    assert not failures, failures[:5]
    assert total >= 500, statuses
    assert not [k for k in statuses if k[1] >= 500]
    # The fuzzing reached generation, not only validation.
    assert statuses[("/v1/chat/completions", 200)] + statuses[("/v1/completions", 200)] > 10
    assert statuses[("/v1/chat/completions", 400)] + statuses[("/v1/completions", 400)] > 50
    # ... and on the Responses API (built on the chat path) too
    assert statuses[("/v1/responses", 200)] > 5 and statuses[("/v1/responses", 400)] > 20


def run_operation(operation, mode, url, statuses, failures) -> None:
    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=url, timeout=60)
        statuses[(operation.path, response.status_code)] += 1
        if response.status_code >= 500:
            failures.append(
                (operation.path, response.status_code, response.text[:300], case.body, case.headers)
            )

    try:
        check()
    except Unsatisfiable:
        # Operations without parameters or body have no invalid inputs to generate.
        assert mode == GenerationMode.NEGATIVE and operation.method.upper() in ("GET", "DELETE")
