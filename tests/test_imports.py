"""The import picture the architecture promises (docs/ARCHITECTURE.md): no import circle
among `justfit`'s modules, counting imports inside functions and TYPE_CHECKING blocks
too, and the three mechanisms (kvexec, phaseswap, statetrans) importing nothing from
`justfit` or `cli`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("justfit", "kvexec", "phaseswap", "statetrans")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module name `path` imports, anywhere in it (a `from package import name`
    counts as the submodule where `name` is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        targets = {t for t in _imports(path) if t in mods and t != name}
        # `from justfit.server import keys` names the submodule, not the package's __init__
        graph[name] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_justfit() -> None:
    graph = {m: {t for t in ts if t.split(".")[0] == "justfit"} for m, ts in _graph().items()
             if m.split(".")[0] == "justfit"}
    assert len(graph) > 40 and _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_mechanisms_import_nothing_of_justfit_or_cli() -> None:
    wrong = {name: sorted(t for t in _imports(path) if t.split(".")[0] in ("justfit", "cli"))
             for name, path in _modules().items() if name.split(".")[0] in ("kvexec", "phaseswap", "statetrans")}
    assert {k: v for k, v in wrong.items() if v} == {}
