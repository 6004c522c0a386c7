"""The import picture the architecture promises (docs/ARCHITECTURE.md): no import circle
anywhere in the tree (`justfit`, the three mechanisms, `cli`, `bench`), counting imports
inside functions and TYPE_CHECKING blocks too, relative ones resolved; no import from a
lower layer up (mechanisms < `justfit` < `cli` < `bench`); and the three mechanisms
(kvexec, phaseswap, statetrans) importing nothing from `justfit` or `cli`."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("justfit", "kvexec", "phaseswap", "statetrans", "cli", "bench")
MECHANISMS = ("kvexec", "phaseswap", "statetrans")
# Lowest first: a module may import its own layer and the layers below, never one above.
LAYERS = (MECHANISMS, ("justfit",), ("cli",), ("bench",))


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, name: str) -> set[str]:
    """Every module name `path` (the module `name`) imports, anywhere in it, relative
    imports resolved against its package (a `from package import name` counts as the
    submodule where `name` is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = _modules(root)
    graph = {}
    for name, path in mods.items():
        targets = {t for t in _imports(path, name) if t in mods and t != name}
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


def _layer(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module.split(".")[0] in layer)


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import from a lower layer up."""
    return sorted((m, t) for m, ts in graph.items() for t in ts if _layer(t) > _layer(m))


def _tree_copy(tmp_path: Path) -> Path:
    """The packages' modules copied under tmp_path, to plant an import in."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=lambda folder, names: [
            n for n in names if not n.endswith(".py") and not (Path(folder) / n).is_dir()])
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + "\n\ndef _planted() -> None:\n    " + line + "\n")


def test_no_import_circle_in_the_tree() -> None:
    graph = _graph()
    assert {m.split(".")[0] for m in graph} == set(PACKAGES) and len(graph) > 150
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_relative_imports_resolve_to_their_modules() -> None:
    graph = _graph()
    # cli/chat_session.py: `from . import common, raw_text`, `from .chat_saves import ...`
    assert {"cli.common", "cli.raw_text", "cli.chat_saves"} <= graph["cli.chat_session"]


def test_the_checker_fails_on_a_circle_planted_in_cli(tmp_path: Path) -> None:
    root = _tree_copy(tmp_path)
    assert _cycles(_graph(root)) == []
    # cli/chat_session.py imports cli/chat_saves.py relatively; plant the way back, in a function
    _plant(root, "cli.chat_saves", "from .chat_session import ChatSession")
    assert _cycles(_graph(root)) == [["cli.chat_saves", "cli.chat_session"]]


def test_the_checker_fails_on_a_circle_planted_in_bench(tmp_path: Path) -> None:
    root = _tree_copy(tmp_path)
    # bench/capacity_report.py imports bench/sweep.py; plant the way back under TYPE_CHECKING
    path = root / "bench" / "sweep.py"
    path.write_text(path.read_text() + "\n\nimport typing\nif typing.TYPE_CHECKING:\n    import bench.capacity_report\n")
    assert _cycles(_graph(root)) == [["bench.capacity_report", "bench.sweep"]]


def test_the_checker_fails_on_an_upward_import_planted(tmp_path: Path) -> None:
    root = _tree_copy(tmp_path)
    _plant(root, "kvexec.hot", "from justfit.engine import facade")
    _plant(root, "justfit.config", "import cli.common")
    assert {("kvexec.hot", "justfit.engine.facade"), ("justfit.config", "cli.common")} <= set(_upward(_graph(root)))


def test_no_import_points_from_a_lower_layer_up() -> None:
    assert _upward(_graph()) == []


def _planning_to_engine(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Inside justfit the planning sits below the engine: its imports that point up."""
    return {(m, t) for m, ts in graph.items() for t in ts
            if m.split(".")[:2] == ["justfit", "planning"] and t.split(".")[:2] == ["justfit", "engine"]}


def test_the_planning_imports_nothing_of_the_engine() -> None:
    assert _planning_to_engine(_graph()) == set()


def test_the_mechanisms_import_nothing_of_justfit_or_cli() -> None:
    wrong = {name: sorted(t for t in _imports(path, name) if t.split(".")[0] in ("justfit", "cli"))
             for name, path in _modules().items() if name.split(".")[0] in MECHANISMS}
    assert {k: v for k, v in wrong.items() if v} == {}
