"""Code health, read from the source alone (AST and text; nothing here imports the project):
layers that point one way (the order declared in docs/architecture.md), no import cycles of any
kind, no private names across packages, short annotated functions.
"""

from __future__ import annotations

import ast
import statistics
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERED = ("services", "lab", "bench", "cli")  # the packages whose import graph is checked
CORE = "services.scheduler.core"
GENERATED = "services.common.pb"  # protoc output: not ours to shape
MAX_FUNCTION_LINES = 60
MAX_MEDIAN_FUNCTION_LINES = 12
ANNOTATED = (
    "services.scheduler.core",
    "services.executor",
    "services.gateway",
    "services.predictor",
    "services.common",
)


# -- the modules and their imports -------------------------------------------------------------


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under LAYERED (a package is its __init__.py)."""
    out = {}
    for top in LAYERED:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@cache
def tree(name: str) -> ast.Module:
    path = modules()[name]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def package_of(name: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to the package itself)."""
    return name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


Function = ast.FunctionDef | ast.AsyncFunctionDef
ImportNode = ast.Import | ast.ImportFrom


def import_nodes(node: ast.AST, type_checking: bool = False) -> Iterator[ImportNode]:
    """Every import statement at any depth; bodies of `if TYPE_CHECKING:` only when asked."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ImportNode):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            if type_checking:
                yield from import_nodes(child, type_checking)
            else:
                for stmt in child.orelse:
                    yield from import_nodes(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from import_nodes(child, type_checking)


def source_of(name: str, node: ast.ImportFrom) -> str:
    """The absolute dotted module a `from ... import` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package_of(name).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(dotted: str) -> str | None:
    """The longest prefix of `dotted` that is one of our modules."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return None


def imported_modules(name: str, type_checking: bool = False) -> set[str]:
    """Our modules that module `name` imports (`from pkg import mod` is an edge to pkg.mod)."""
    out = set()
    for node in import_nodes(tree(name), type_checking):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = source_of(name, node)
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in modules() else source
                for a in node.names
            ]
        out.update(t for t in map(_known, targets) if t is not None)
    out.discard(name)
    return out


@cache
def graph() -> dict[str, set[str]]:
    """Every import edge: module level, inside functions and under `if TYPE_CHECKING:` (a
    circle closed by a type-only or deferred import is still a circle)."""
    return {name: imported_modules(name, type_checking=True) for name in modules()}


# -- the declared layers -----------------------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"


@cache
def declared_layers() -> list[str]:
    """The packages of docs/architecture.md's "How the code is organised" block, top first, as
    dotted names (`services/scheduler/core/` -> services.scheduler.core)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("## How the code is organised", 1)[1]
    block = section.split("```", 2)[1]
    paths = [line.split()[0] for line in block.splitlines() if line.strip()]
    return [p.strip("/").removesuffix(".py").replace("/", ".") for p in paths]


def layer_of(name: str, layers: list[str]) -> int | None:
    """Index of the most specific declared layer holding module `name` (None: none does)."""
    best = [(len(p), i) for i, p in enumerate(layers) if in_package(name, p)]
    return max(best)[1] if best else None


def upward_imports(edges: dict[str, set[str]], layers: list[str]) -> list[str]:
    """Each import from a module to one in a layer above its own."""
    found = []
    for name, targets in sorted(edges.items()):
        here = layer_of(name, layers)
        for target in sorted(targets):
            there = layer_of(target, layers)
            if here is not None and there is not None and there < here:
                found.append(f"{name} ({layers[here]}) imports {target} ({layers[there]})")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has a few hundred nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_in(edges, c) for c in components]


def _cycle_in(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(component)}")


# -- functions ---------------------------------------------------------------------------------


def functions(node: ast.AST) -> Iterator[Function]:
    for child in ast.walk(node):
        if isinstance(child, Function):
            yield child


def _blocks(stmt: ast.If | ast.Try) -> list[list[ast.stmt]]:
    if isinstance(stmt, ast.If):
        return [stmt.body, stmt.orelse]
    return [stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)]


def api_functions(module: ast.Module) -> Iterator[tuple[str, Function, bool]]:
    """(qualified name, def, is_method) of module-level functions and methods of module-level
    classes (nested classes included); functions local to a function are not API."""

    def walk(body: list[ast.stmt], prefix: str, in_class: bool):
        for stmt in body:
            if isinstance(stmt, Function):
                yield f"{prefix}{stmt.name}", stmt, in_class
            elif isinstance(stmt, ast.ClassDef):
                yield from walk(stmt.body, f"{prefix}{stmt.name}.", True)
            elif isinstance(stmt, ast.If | ast.Try):
                for block in _blocks(stmt):
                    yield from walk(block, prefix, in_class)

    yield from walk(module.body, "", False)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_kernel(fn: Function) -> bool:
    """A `@triton.jit` (or `@triton.jit(...)`) kernel: Triton gives parameter annotations a
    meaning of their own."""
    decorators = [d.func if isinstance(d, ast.Call) else d for d in fn.decorator_list]
    return any(
        (d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", None)) == "jit"
        for d in decorators
    )


def missing_annotations(fn: Function, is_method: bool) -> list[str]:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if is_method and not static and positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    params = [*positional, *args.kwonlyargs]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    missing = [a.arg for a in params if a.annotation is None]
    if fn.returns is None and fn.name != "__init__":
        missing.append("return")
    return missing


# -- the checks --------------------------------------------------------------------------------


def test_the_import_graph_has_no_cycle():
    assert len(graph()) > 50 and any(graph().values())  # the walk found the code
    found = cycles(graph())
    assert not found, (
        "import cycles (`if TYPE_CHECKING:` and function-level imports count):\n"
        + "\n".join("  " + " -> ".join(c) for c in found)
    )


def test_the_cycle_finder_reports_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_and_function_level_imports_are_edges():
    module = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.common import step\n"
        "def f():\n    import services.common.sampling\n"
    )
    found = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in import_nodes(module, type_checking=True)
        for alias in node.names
    }
    assert {"services.common", "services.common.sampling"} <= found
    assert "services.common" not in {
        n.module for n in import_nodes(module) if isinstance(n, ast.ImportFrom)
    }


def test_no_import_runs_up_the_declared_layers():
    layers = declared_layers()
    assert layers[0] == "cli" and layers[-1] == "services.common", layers
    assert {"lab", "services.scheduler.core", "services.executor"} <= set(layers)
    unplaced = [n for n in modules() if n not in LAYERED and layer_of(n, layers) is None]
    assert not unplaced, f"modules in no layer of {ARCHITECTURE.name}: {unplaced}"
    found = upward_imports(graph(), layers)
    assert not found, "imports up the layers of docs/architecture.md:\n  " + "\n  ".join(found)


def test_the_layer_check_reports_an_upward_import():
    layers = ["top", "top.mid", "low"]
    edges = {"low.a": {"top.mid.b"}, "top.mid.b": {"low.a"}, "top.c": {"top.mid.b"}}
    assert upward_imports(edges, layers) == ["low.a (low) imports top.mid.b (top.mid)"]


OUTSIDE_SERVICES = ("bench", "lab", "cli")  # what the images' serving code must not need


def _names_outside_services(name: str, module: ast.Module) -> Iterator[str]:
    """What module `name` (parsed: `module`) imports, or names in a string (importlib,
    `python -m`), from a package outside services/."""
    for node in import_nodes(module, type_checking=True):
        sources = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [source_of(name, node)]
        )
        for s in sources:
            if any(in_package(s, p) for p in OUTSIDE_SERVICES):
                yield f"{name}:{node.lineno} imports {s}"
    for node in ast.walk(module):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            dotted = node.value.strip()
            if any(dotted.startswith(p + ".") or dotted == p for p in OUTSIDE_SERVICES):
                yield f"{name}:{node.lineno} names {dotted!r}"


def test_services_never_import_bench_lab_or_the_cli():
    """Strings count: a module named to importlib or spawned with `python -m` is a
    dependency all the same."""
    offenders = [
        o
        for n in modules()
        if in_package(n, "services")
        for o in _names_outside_services(n, tree(n))
    ]
    assert not offenders, "services/ must not depend on bench/, lab/ or cli/:\n  " + "\n  ".join(
        offenders
    )


def test_the_outside_check_sees_a_module_named_in_a_string():
    module = ast.parse("import importlib\nimportlib.import_module('lab.sim.cli')\nimport cli\n")
    assert list(_names_outside_services("services.x", module)) == [
        "services.x:3 imports cli",
        "services.x:2 names 'lab.sim.cli'",
    ]


def test_no_private_name_is_imported_from_another_package():
    offenders = []
    for name in modules():
        for node in import_nodes(tree(name), type_checking=True):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = source_of(name, node)
            home = _known(source)
            if home is not None and package_of(home) == package_of(name):
                continue
            offenders += [
                f"{name}:{node.lineno} imports {a.name} from {source}"
                for a in node.names
                if is_private(a.name)
            ]
    assert not offenders, (
        "private names imported across packages (make them public):\n  " + "\n  ".join(offenders)
    )


def core_private_names() -> set[str]:
    names = set()
    for name in modules():
        if not in_package(name, CORE):
            continue
        for node in ast.walk(tree(name)):
            if isinstance(node, Function | ast.ClassDef):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    for stmt in node.body:
                        targets = (
                            stmt.targets
                            if isinstance(stmt, ast.Assign)
                            else [stmt.target]
                            if isinstance(stmt, ast.AnnAssign)
                            else []
                        )
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return {n for n in names if is_private(n)}


def private_uses(name: str, module: ast.Module, private: set[str]) -> list[str]:
    """Where module `name` reaches into `private` names (`obj._x`, obj not self/cls) or imports
    a private name from the core."""
    found = []
    for node in ast.walk(module):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{name}:{node.lineno} uses .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and in_package(source_of(name, node), CORE):
            found += [
                f"{name}:{node.lineno} imports {a.name}" for a in node.names if is_private(a.name)
            ]
    return found


def test_the_private_use_check_sees_reaching_in():
    module = ast.parse(
        "from services.scheduler.core.batch import _helper\n"
        "def f(sched):\n    sched._inflight = None\n    self._inflight = 1\n"
        "    return sched.block_manager._free_dev, sched._mine\n"
    )
    found = private_uses("services.scheduler.x", module, {"_inflight", "_free_dev"})
    assert found == [
        "services.scheduler.x:1 imports _helper",
        "services.scheduler.x:3 uses ._inflight",
        "services.scheduler.x:5 uses ._free_dev",
    ]


def test_nothing_outside_the_core_uses_its_private_names():
    private = core_private_names()
    assert len(private) > 10  # the collection found them
    offenders = [
        use
        for name in modules()
        if not in_package(name, CORE)
        for use in private_uses(name, tree(name), private)
    ]
    assert not offenders, (
        "private names of services/scheduler/core used outside it "
        "(give the core a public method):\n  " + "\n  ".join(offenders)
    )


def test_functions_are_short():
    lengths = {}
    for name in modules():  # services/, lab/ and bench/
        if in_package(name, GENERATED):
            continue
        for fn in functions(tree(name)):
            lengths[f"{name}:{fn.lineno} {fn.name}"] = fn.end_lineno - fn.lineno + 1
    long = sorted((n, where) for where, n in lengths.items() if n > MAX_FUNCTION_LINES)
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(
        f"{where}: {n}" for n, where in reversed(long)
    )
    median = statistics.median(lengths.values())
    assert median < MAX_MEDIAN_FUNCTION_LINES, (
        f"median function length {median} lines (want < {MAX_MEDIAN_FUNCTION_LINES})"
    )


def annotation_offenders() -> dict[str, list[str]]:
    """Per package of ANNOTATED: public functions and methods missing annotations."""
    out: dict[str, list[str]] = {package: [] for package in ANNOTATED}
    for name in modules():
        package = next((p for p in ANNOTATED if in_package(name, p)), None)
        if package is None or in_package(name, GENERATED):
            continue
        for qualname, fn, is_method in api_functions(tree(name)):
            if (
                is_private(fn.name)
                or (fn.name.startswith("__") and fn.name != "__init__")
                or is_kernel(fn)
            ):
                continue
            missing = missing_annotations(fn, is_method)
            if missing:
                out[package].append(f"{name}:{fn.lineno} {qualname} ({', '.join(missing)})")
    return out


def test_public_functions_are_annotated():
    offenders = annotation_offenders()
    report = [
        f"  {package} ({len(found)}):\n    " + "\n    ".join(found)
        for package, found in offenders.items()
        if found
    ]
    assert not report, "public functions missing annotations:\n" + "\n".join(report)


def test_the_annotation_check_sees_missing_annotations():
    module = ast.parse(
        "class A:\n    def f(self, x, *a: int, **k) -> None: ...\n"
        "    def __init__(self, y: int): ...\n"
        "def g(z: int): ...\n"
    )
    found = {q: missing_annotations(fn, m) for q, fn, m in api_functions(module)}
    assert found == {"A.f": ["x", "k"], "A.__init__": [], "g": ["return"]}


def tracked_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in listed.decode().split("\0") if p]


def test_no_file_points_outside_the_repository_design_notes():
    needle = ("DESIGN" + ".md").encode()
    files = [p for p in tracked_files() if p.is_file() and p != Path(__file__).resolve()]
    assert len(files) > 100
    offenders = [str(p.relative_to(ROOT)) for p in files if needle in p.read_bytes()]
    assert not offenders, (
        f"{needle.decode()} is not in the repository; point at docs/ "
        "instead:\n  " + "\n  ".join(offenders)
    )


def test_ceiling_division_has_one_definition():
    """Blocks for n tokens are `ceil_div(n, block_size)` (services/common/arith.py) everywhere,
    not the `-(-n // b)` idiom written out again."""
    home = ROOT / "services" / "common" / "arith.py"
    # BlockManager.allocate runs once per scheduled request per step: the call is inlined there
    hot_path = ROOT / "services" / "scheduler" / "core" / "block_manager.py"
    idiom = "-(-"
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in modules().values()
        if path not in (home, hot_path)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if idiom in line and "//" in line
    ]
    hot = [line for line in hot_path.read_text().splitlines() if idiom in line]
    assert len(hot) == 1, f"only allocate() inlines it: {hot}"
    assert not offenders, f"write ceil_div(a, b) instead of -(-a // b): {offenders}"


def test_no_metric_name_is_exported_by_two_services():
    """Each service's registry holds its own names: the scheduler's vLLM names (with
    `model_name`), `alise:gateway_*` for what the HTTP client saw, and so on."""
    from services.executor.metrics import ExecutorMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.predictor.servicer import PredictorMetrics
    from services.scheduler.metrics import SchedulerMetrics

    names = {}
    for service in (GatewayMetrics(), SchedulerMetrics("m"), ExecutorMetrics(), PredictorMetrics()):
        names[type(service).__name__] = {m.name for m in service.registry.collect()}
    seen: dict[str, str] = {}
    for service, family in names.items():
        for name in family:
            assert name not in seen, f"{name} is exported by {seen[name]} and {service}"
            seen[name] = service
    vllm = {n for n in names["SchedulerMetrics"] if n.startswith("vllm:")}
    assert {"vllm:time_to_first_token_seconds", "vllm:num_requests_running"} <= vllm
    assert all(n.startswith("alise:gateway_") for n in names["GatewayMetrics"])


def test_grafana_dashboard_reads_metrics_the_services_export():
    import json
    import re

    from services.executor.metrics import ExecutorMetrics
    from services.gateway.metrics import GatewayMetrics
    from services.predictor.servicer import PredictorMetrics
    from services.scheduler.metrics import SchedulerMetrics

    exported = set()
    for service in (GatewayMetrics(), SchedulerMetrics("m"), ExecutorMetrics(), PredictorMetrics()):
        for family in service.registry.collect():
            exported.update(sample.name for sample in family.samples)
            exported.add(family.name + ("_total" if family.type == "counter" else ""))
    dashboard = json.loads((ROOT / "deploy/grafana/alise-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:vllm|alise):[a-z0-9_]+)", e)}
    assert len(used) >= 15
    assert not used - exported, sorted(used - exported)
