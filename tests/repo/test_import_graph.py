"""The import graph of `worker/` and `schemas/` has no cycle (every import counts:
module level, inside functions and under TYPE_CHECKING), so each module can be read,
tested and moved on its own; `schemas/` imports nothing of `worker/` or torch."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "schemas")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` that names a
    submodule counts as importing that submodule, else the package)."""
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in files else node.module)
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_schemas_import_no_worker_code():
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("schemas"):
            assert not [d for d in deps if d.startswith("worker")], (mod, deps)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# (importer room, imported room) pairs that break a layer rule; rooms are
# `worker.<folder>` (or the top-level module), `schemas` is its own room.
FORBIDDEN = {
    "engine": {"serve", "client", "gateway", "cli"},
    "model": {"serve", "client", "gateway", "cli"},  # engine.outputs holds the runner's contract objects
    "config": {"serve", "client", "gateway", "cli", "engine", "model"},
    "client": {"serve", "engine", "model", "gateway", "cli"},
    "security": {"serve", "engine", "model", "client", "gateway", "cli"},
    "obs": {"serve", "client", "gateway", "cli"},
}
GATEWAY_MAY_IMPORT = {"gateway", "client", "security", "config", "obs", "schemas"}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "schemas":
        return "schemas"
    return parts[1] if len(parts) > 1 else "worker"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        src = room(mod)
        for d in sorted(deps):
            dst = room(d)
            if dst in FORBIDDEN.get(src, ()) or (src == "gateway" and dst not in GATEWAY_MAY_IMPORT):
                bad.append(f"{mod} ({src}) imports {d} ({dst})")
    return bad


def test_layer_rules():
    bad = layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_the_layer_rules_catch_a_bad_edge():
    assert layer_violations({"worker.engine.core": {"worker.serve.jobs"}})
    assert layer_violations({"worker.gateway.app": {"worker.engine"}})
    assert layer_violations({"worker.security.access": {"worker.serve.claims"}})
    assert not layer_violations({"worker.gateway.app": {"worker.client.inflight", "schemas.wire"}})


def test_no_private_names_imported_across_modules():
    """`from worker.x import _name` couples one module to another's internals."""
    bad = []
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    bad += [f"{p.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def attributes_set_outside_init(source: str) -> list[str]:
    """`Class.method sets self.x` for every attribute a method other than `__init__`
    assigns first (property setters aside): such an attribute does not exist until that
    method ran, and readers end up guarding it with `hasattr`."""
    bad = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        methods = {f.name: f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if "__init__" not in methods:
            continue

        def assigned(fn) -> set[str]:
            out = set()
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else (
                    [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else [])
                for t in targets:
                    out.update(e.attr for e in ast.walk(t) if isinstance(e, ast.Attribute)
                               and isinstance(e.value, ast.Name) and e.value.id == "self"
                               and isinstance(e.ctx, ast.Store))
            return out

        init = assigned(methods["__init__"])
        setters = {name for name, f in methods.items()
                   if any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in f.decorator_list)}
        for name, fn in methods.items():
            if name != "__init__":
                bad += [f"{cls.name}.{name} sets self.{a}" for a in sorted(assigned(fn) - init - setters)]
    return bad


def test_every_attribute_exists_from_init():
    bad = [f"{p.relative_to(ROOT)}: {b}" for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
           for b in attributes_set_outside_init(p.read_text())]
    assert not bad, "\n".join(bad)


def test_the_attribute_check_catches_a_late_attribute():
    src = "class A:\n    def __init__(self):\n        self.a = 1\n    async def start(self):\n        self.b = 2\n"
    assert attributes_set_outside_init(src) == ["A.start sets self.b"]


def layer_rules_markdown() -> str:
    """The layer rules as the architecture page states them (generated from the tables above)."""
    lines = [f"- `{src}` imports none of " + ", ".join(f"`{r}`" for r in sorted(banned)) + ";"
             for src, banned in FORBIDDEN.items()]
    lines.append("- `gateway` imports only " + ", ".join(f"`{r}`" for r in sorted(GATEWAY_MAY_IMPORT - {"gateway"}))
                 + " (and itself).")
    return "\n".join(lines)


BEGIN, END = "<!-- layer rules: tests/repo/test_import_graph.py -->", "<!-- end of the layer rules -->"


def test_the_architecture_page_states_these_rules():
    """docs/architecture.md shows the rules this test holds (one source: the tables above)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    shown = page[page.index(BEGIN) + len(BEGIN):page.index(END)].strip()
    assert shown == layer_rules_markdown(), f"put this between the markers:\n{layer_rules_markdown()}"
