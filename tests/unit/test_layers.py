"""The import rules of the package map (README "Code layout"), read from the source with ``ast``.

Each module belongs to a layer; a layer may import only the layers its row lists (and itself, and
the base modules). Today's breaches are listed by name in ``KNOWN``, each with the move that ends
it: the test fails on a new breach, and on a listed one that no longer exists, so the list only
shrinks. The same holds for import cycles, for torch outside the worker, and for module sizes.
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
    "errors": BASE, "log": BASE, "config": BASE, "etcd_config": BASE, "retry": BASE,
    "settings": "settings",
    "events": "events",
    "cli": "cli",
    "": "api",  # elasticd/__init__.py: the worker API's re-exports
    "demo": TOOLING,
}
PACKAGES = {"store": "store", "wire": "wire", "rendezvous": "rendezvous", "worker": "worker", "agent": "agent",
            "ops": "ops", "testing": TOOLING, "bench": TOOLING, "chaos": TOOLING}

# layer -> the layers it may import (besides itself and the base modules)
ALLOWED: dict[str, set[str]] = {
    BASE: set(),
    "settings": set(),
    "store": set(),
    "wire": {"store"},
    "events": {"wire", "store"},
    "rendezvous": {"wire", "store", "events"},
    "worker": {"rendezvous", "wire", "events", "store", "settings"},
    "agent": {"rendezvous", "wire", "events", "store", "settings"},  # rendezvous: the node relay
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

# Today's breaches, each with the move that ends it (issue 11's order of moves).
KNOWN: dict[tuple[str, str], str] = {}

TORCH_LAYERS = {"worker", TOOLING}

# The library's one reader of the process environment is settings; store.etcd only sets protobuf's
# and gRPC's defaults before it imports them. The dev tooling builds its children's environments.
ENVIRON_READERS = {"settings", "store.etcd"}

# Lines: a library module at most 500, an entry point at most 850 (issue 11).
MAX_LINES = 500
ENTRY_POINTS = {"cli", "demo", "chaos.__main__", "bench.__main__", "bench.recovery", "bench.agent", "bench.checkpoint",
                "bench.outage"}
MAX_ENTRY_LINES = 850
# The trainer is the worker API in one class (its public methods and their docs); the state is one
# concept (what a member holds, packed and checked). Their functions stay short.
KNOWN_LONG: set[str] = {"worker.trainer", "worker.state"}

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
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "environb", "getenv", "getenvb")):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "environb", "getenv", "getenvb") for a in node.names):
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
    assert not new, "imports that break the layer rules (README \"Code layout\"): " + ", ".join(
        f"elasticd.{a} -> elasticd.{b} ({layer_of(a)} may not import {layer_of(b)})" for a, b in new)
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


def test_module_sizes() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    too_long = sorted(m for m, n in sizes.items()
                      if n > (MAX_ENTRY_LINES if m in ENTRY_POINTS else MAX_LINES) and m not in KNOWN_LONG)
    assert not too_long, "modules over their size (500 lines, 850 for entry points): " + ", ".join(
        f"{m} ({sizes[m]})" for m in too_long)
    fine = sorted(m for m in KNOWN_LONG
                  if sizes.get(m, 0) <= (MAX_ENTRY_LINES if m in ENTRY_POINTS else MAX_LINES))
    assert not fine, f"listed as too long but within the bound now (delete them from KNOWN_LONG): {fine}"


@pytest.mark.parametrize(("table", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, {frozenset({"a", "b"})}),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, set()),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, {frozenset({"a", "b", "c"})}),
])
def test_cycle_finder(table: dict[str, set[str]], expected: set[frozenset[str]]) -> None:
    assert _cycles(table) == expected
