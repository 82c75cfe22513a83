"""Scheduling policies, one file each, registered by name."""
from services.scheduler.core.policies import (  # noqa: F401
    accelgen,
    alise,
    fastserve,
    fcfs,
    hybrid,
    oracle,
    orca,
    request_level,
    sarathi,
)
from services.scheduler.core.policies.base import (  # noqa: F401
    Policy,
    available_policies,
    make_policy,
    policy_knobs,
    register_policy,
)
