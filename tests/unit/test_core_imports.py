"""The scheduling core must stay free of torch, grpc, redis and asyncio (docs/scheduling.md)."""

import json
import subprocess
import sys

FORBIDDEN = ("torch", "grpc", "redis", "asyncio", "numpy")


def test_core_imports_no_heavy_or_io_modules():
    code = (
        "import sys, json\n"
        "import services.scheduler.core.scheduler, services.scheduler.core.placement\n"
        "import services.scheduler.core.roofline\n"
        "from services.scheduler.core.policies import available_policies, make_policy\n"
        "names = available_policies()\n"
        "[make_policy(n) for n in names]\n"
        "print(json.dumps({'policies': names, 'mods': sorted(sys.modules)}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    data = json.loads(res.stdout)
    assert "fcfs" in data["policies"]
    bad = [m for m in data["mods"] if m.split(".")[0] in FORBIDDEN]
    assert not bad, f"core imported {bad}"
