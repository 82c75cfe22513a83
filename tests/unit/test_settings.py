import pytest
from pydantic import ValidationError

from services.common.settings import (
    ALL_SETTINGS,
    ExecutorSettings,
    GatewaySettings,
    SchedulerSettings,
    env_var_names,
    settings_table,
)


def test_reads_environment(monkeypatch):
    monkeypatch.setenv("ALISE_EXECUTOR_PORT", "6123")
    monkeypatch.setenv("ALISE_KV_DTYPE", "int8")
    settings = ExecutorSettings()
    assert settings.executor_port == 6123
    assert settings.kv_dtype == "int8"


def test_lists_accept_commas_and_json(monkeypatch):
    monkeypatch.setenv("ALISE_EXECUTORS", "127.0.0.1:1, 127.0.0.1:2")
    assert SchedulerSettings().executors == ["127.0.0.1:1", "127.0.0.1:2"]
    monkeypatch.setenv("ALISE_API_KEYS", '["a", "b"]')
    assert GatewaySettings().api_keys == ["a", "b"]


@pytest.mark.parametrize(
    "var,value,needle",
    [
        ("ALISE_EXECUTOR_PORT", "70000", "executor_port"),
        ("ALISE_KV_DTYPE", "int4", "kv_dtype"),
        ("ALISE_BLOCK_SIZE", "zero", "block_size"),
        ("ALISE_LOG_LEVEL", "LOUD", "log_level"),
    ],
)
def test_rejects_invalid_values_with_clear_message(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError) as info:
        ExecutorSettings()
    assert needle in str(info.value)


def test_every_field_is_documented_and_names_are_consistent():
    seen: dict[str, object] = {}
    for cls in ALL_SETTINGS:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"
            if name in seen:  # a shared name must mean the same thing
                assert seen[name] == field.annotation, name
            seen[name] = field.annotation
    assert "ALISE_REDIS_URL" in env_var_names()
    assert "ALISE_QDRANT_URL" in env_var_names()
    assert len(settings_table()) == len(seen)
