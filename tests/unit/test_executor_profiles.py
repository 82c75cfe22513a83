"""Describe reports a cost-model profile: the configured file, else a bundled one that matches
the device, model, dtype and weight format, else none (the scheduler then uses its
defaults)."""

import json

from services.common.pb import executor_pb2
from services.executor.engine import BUNDLED_PROFILES, bundled_profile
from services.scheduler.core.cost_model import CostModel
from services.scheduler.loop.executors import cost_model_for


def test_bundled_cpu_profile_matches_only_its_device_model_and_dtype():
    text = bundled_profile("cpu", "smollm2-135m-instruct", "float32")
    profile = json.loads(text)
    assert profile["device"] == "cpu" and profile["coefficients"]["c0"] > 0
    assert CostModel.from_profile(profile).c_prefill == profile["coefficients"]["c_prefill"]
    assert bundled_profile("cuda", "smollm2-135m-instruct", "float32") == ""
    bf16 = json.loads(bundled_profile("cpu", "smollm2-135m-instruct", "bfloat16"))
    assert bf16["dtype"] == "bfloat16" and bf16["coefficients"] != profile["coefficients"]
    assert bundled_profile("cpu", "smollm2-135m-instruct", "float16") == ""
    assert bundled_profile("cpu", "some-other-model", "float32") == ""
    int4 = json.loads(bundled_profile("cpu", "smollm2-135m-instruct", "bfloat16", "int4"))
    assert int4["weights"] == "int4" and int4["coefficients"] != bf16["coefficients"]
    assert bundled_profile("cpu", "smollm2-135m-instruct", "bfloat16", "int8") == ""
    assert any(BUNDLED_PROFILES.glob("*.json"))


def test_scheduler_cost_model_takes_the_pool_from_the_executor():
    text = bundled_profile("cpu", "smollm2-135m-instruct", "float32")
    info = executor_pb2.ExecutorInfo(
        profile_json=text, block_size=16, num_device_blocks=100, num_host_blocks=7
    )
    cm = cost_model_for(info)
    assert (cm.num_device_blocks, cm.num_host_blocks) == (100, 7)
    assert cm.c0 == json.loads(text)["coefficients"]["c0"]
    broken = executor_pb2.ExecutorInfo(profile_json="[1, 2]", block_size=16, num_device_blocks=9)
    assert cost_model_for(broken).num_device_blocks == 9  # defaults, not a crash
