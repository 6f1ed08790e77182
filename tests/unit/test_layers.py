"""The import rules of the package map (docs/design/architecture.md), read from the source with ``ast``.

Each module belongs to a layer; a layer may import only the layers its row lists (and itself, and
the base modules). Today's breaches are listed by name in ``KNOWN``, each with the move that ends
it: the test fails on a new breach, and on a listed one that no longer exists, so the list only
shrinks. The same holds for import cycles, for torch outside the worker, and for long functions.
Also: the library reads the process environment in settings only.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parents[2] / "elasticd"

BASE = "base"
TOOLING = "tooling"  # demo, chaos, bench, the local cluster and the audit reader: anything goes

# The layer of each module outside a package (a package names the layer of its modules; the
# dev tooling's packages are all one layer).
FLAT = {
    "errors": BASE,
    "log": BASE,
    "config": BASE,
    "retry": BASE,
    "settings": "settings",
    "settings_doc": "settings",
    "events": "events",
    "cli": "cli",
    "": "api",  # elasticd/__init__.py: the worker API's re-exports
    "demo": TOOLING,
}
PACKAGES = {
    "store": "store",
    "wire": "wire",
    "relay": "relay",
    "rendezvous": "rendezvous",
    "worker": "worker",
    "agent": "agent",
    "ops": "ops",
    "testing": TOOLING,
    "bench": TOOLING,
    "chaos": TOOLING,
}

# layer -> the layers it may import (besides itself and the base modules)
ALLOWED: dict[str, set[str]] = {
    BASE: set(),
    "settings": set(),
    "store": set(),
    "wire": {"store"},
    "events": {"wire", "store"},
    "relay": {"wire", "store"},  # the node relay: a transport between an agent and its workers
    "rendezvous": {"wire", "store", "events"},
    "worker": {"rendezvous", "relay", "wire", "events", "store", "settings"},
    "agent": {"relay", "wire", "events", "store", "settings"},
    "ops": {"wire", "store"},
    "cli": {"agent", "ops", "store", "wire", "settings"},
    "api": {"worker", "settings"},
    TOOLING: {"*"},
}

# Fine-grained rules within the allowed layers: only the store's port, never its client, except
# where named (the worker's default wiring of an etcd client, rejoin.connect; the cli's; and
# store.auth, etcd's users and roles, which the client's calls carry).
ETCD_CLIENT = "store.etcd"
MAY_USE_ETCD_CLIENT = {"worker.rejoin", "cli", "store.auth"}

# Today's breaches, each with the move that ends it.
KNOWN: dict[tuple[str, str], str] = {}

TORCH_LAYERS = {"worker", TOOLING}

# The library's one reader of the process environment is settings; store.etcd only sets protobuf's
# and gRPC's defaults before it imports them. The dev tooling builds its children's environments.
ENVIRON_READERS = {"settings", "store.etcd"}

# Functions: at most MAX_FUNCTION_LINES lines each (a module is as long as its concept needs;
# the formatter, tests/unit/test_format.py, keeps nothing compacted). The longer ones are listed
# with their length: a listed one may only shrink, and leaves the list once within the budget.
MAX_FUNCTION_LINES = 60
KNOWN_LONG_FUNCTIONS: dict[str, int] = {
    "agent.restart:GroupRestartAgent._apply": 89,
    "agent.restart_decide:_joining": 76,
    "bench.checkpoint:run_throughput": 84,
    "bench.recovery:_transfer_worker": 103,
    "bench.recovery:render_recovery": 97,
    "bench.recovery:run_fault_rep": 87,
    "bench.recovery:run_recovery": 119,
    "bench.rendezvous:_measure": 86,
    "bench.rendezvous:calibrate": 63,
    "bench.rendezvous_members:_member_process": 97,
    "chaos.__main__:ChaosRun.inject": 97,
    "chaos.__main__:ChaosRun.run": 92,
    "chaos.judge:judge": 116,
    "chaos.report:render_table": 66,
    "chaos.report:report_to_dict": 72,
    "chaos.schedule:parse_args": 91,
    "cli:build_ctl_parser": 158,
    "config:AgentConfig.__post_init__": 84,
    "demo:Demo.verdict": 67,
    "ops.render:render_table": 76,
    "ops.render:to_dict": 113,
    "ops.status:build_status": 141,
    "rendezvous.decide:publish_decision": 120,
    "rendezvous.membership:Membership._join": 121,
    "settings:load_agent_config": 78,
    "store.etcd:EtcdClient.watch_prefix": 71,
    "testing.audit:check": 105,
    "wire.snapshot:parse_snapshot": 65,
    "worker.state.durable:CheckpointWriter._write": 65,
    "worker.data.loader:ElasticLoader.__init__": 61,
    "worker.state.training:TrainingState._decode": 79,
    "worker.state.sync:_transfer": 72,
    "worker.state.sync:sync_state": 74,
    "worker.trainer:ElasticTrainer.__init__": 73,
}

KNOWN_CYCLES: set[frozenset[str]] = set()


def modules() -> dict[str, Path]:
    """Module name relative to ``elasticd`` ("" for the package itself) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, known: set[str]) -> Iterator[str]:
    """The elasticd modules that ``path`` imports (anywhere in it), relative to ``elasticd``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "elasticd" or a.name.startswith("elasticd."):
                    yield a.name.removeprefix("elasticd").removeprefix(".")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "elasticd" and not node.module.startswith("elasticd."):
                continue
            base = node.module.removeprefix("elasticd").removeprefix(".")
            for a in node.names:  # `from elasticd.bench import agent`: a module, or a name in one
                sub = f"{base}.{a.name}" if base else a.name
                yield sub if sub in known else base


def imports_torch(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            return True
    return False


def reads_environ(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr in ("environ", "environb", "getenv", "getenvb")
        ):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in ("environ", "environb", "getenv", "getenvb") for a in node.names)
        ):
            return True
    return False


def layer_of(module: str) -> str:
    top = module.split(".")[0]
    if top in PACKAGES:
        return PACKAGES[top]
    if module in FLAT:
        return FLAT[module]
    raise AssertionError(f"elasticd.{module} has no layer: put it in a package, or in FLAT")


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: {i for i in imports_of(p, known) if i != m} for m, p in mods.items()}


def breaches() -> set[tuple[str, str]]:
    found = set()
    for m, targets in graph().items():
        lm = layer_of(m)
        for t in targets:
            lt = layer_of(t)
            if lt == TOOLING and lm != TOOLING:
                found.add((m, t))  # nothing in the library imports the dev tooling
            elif t == ETCD_CLIENT and m not in MAY_USE_ETCD_CLIENT and lm != TOOLING:
                found.add((m, t))
            elif lt not in {lm, BASE} and "*" not in ALLOWED[lm] and lt not in ALLOWED[lm]:
                found.add((m, t))
    return found


def test_every_module_has_a_layer() -> None:
    for m in modules():
        layer_of(m)


def test_imports_follow_the_layer_rules() -> None:
    found = breaches()
    new = sorted(found - set(KNOWN))
    assert not new, "imports that break the layer rules (docs/design/architecture.md): " + ", ".join(
        f"elasticd.{a} -> elasticd.{b} ({layer_of(a)} may not import {layer_of(b)})" for a, b in new
    )
    gone = sorted(set(KNOWN) - found)
    assert not gone, f"listed as known breaches but gone (delete them from KNOWN): {gone}"


def test_torch_only_in_the_worker() -> None:
    heavy = sorted(m for m, p in modules().items() if imports_torch(p) and layer_of(m) not in TORCH_LAYERS)
    assert not heavy, f"torch imported outside the worker: {heavy}"


def test_only_settings_reads_the_environment() -> None:
    readers = {m for m, p in modules().items() if layer_of(m) != TOOLING and reads_environ(p)}
    assert readers <= ENVIRON_READERS, f"os.environ read outside settings: {sorted(readers - ENVIRON_READERS)}"
    assert "settings" in readers


def _cycles(g: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: set[frozenset[str]] = set()
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(frozenset(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    g = graph()
    g.pop("", None)  # the package's re-exports are imported by everything through `elasticd.x`
    cycles = _cycles(g)
    known = {c for c in KNOWN_CYCLES}
    merged = {c for c in cycles if not any(k <= c for k in known)}
    assert not merged, f"import cycles: {[sorted(c) for c in merged]}"
    gone = {k for k in known if not any(k <= c for c in cycles)}
    assert not gone, f"listed as known cycles but gone (delete them): {[sorted(k) for k in gone]}"


def function_lengths() -> dict[str, int]:
    """``module:Class.function`` -> its length in lines, its docstring excluded (decorators
    excluded too), nested functions too."""
    out: dict[str, int] = {}

    def length(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        assert fn.end_lineno is not None
        n = fn.end_lineno - fn.lineno + 1
        first = fn.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            assert first.end_lineno is not None
            n -= first.end_lineno - first.lineno + 1
        return n

    def walk(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{module}:{prefix}{child.name}"] = length(child)
                walk(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, module, f"{prefix}{child.name}.")
            else:
                walk(child, module, prefix)

    for module, path in modules().items():
        walk(ast.parse(path.read_text()), module, "")
    return out


def test_function_lengths() -> None:
    lengths = function_lengths()
    too_long = sorted(f for f, n in lengths.items() if n > MAX_FUNCTION_LINES and f not in KNOWN_LONG_FUNCTIONS)
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(
        f"{f} ({lengths[f]})" for f in too_long
    )
    grew = sorted(f for f, n in KNOWN_LONG_FUNCTIONS.items() if lengths.get(f, 0) > n)
    assert not grew, "listed long functions that grew (they may only shrink): " + ", ".join(
        f"{f} ({KNOWN_LONG_FUNCTIONS[f]} -> {lengths[f]})" for f in grew
    )
    fine = sorted(f for f in KNOWN_LONG_FUNCTIONS if lengths.get(f, 0) <= MAX_FUNCTION_LINES)
    assert not fine, f"listed as too long but within the budget now (delete them from KNOWN_LONG_FUNCTIONS): {fine}"


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, {frozenset({"a", "b"})}),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, set()),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, {frozenset({"a", "b", "c"})}),
    ],
)
def test_cycle_finder(table: dict[str, set[str]], expected: set[frozenset[str]]) -> None:
    assert _cycles(table) == expected
