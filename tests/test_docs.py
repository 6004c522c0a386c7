"""The documentation points at things that exist: every link resolves (its heading too),
every repository path and benchmark result file it cites is there, bench/results/ holds
only the result files the docs cite (and their index), and the README keeps the two
fresh-machine commands that CI runs, and stays a page for users."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "bench" / "results"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# A cited benchmark result: SUITE-YYYYMMDD[-HHMMSS][-TAG], with or without its folder and suffix.
RESULT = re.compile(r"\b([a-z]+(?:-[a-z0-9]+)*-\d{8}(?:-\d{6})?(?:-[a-z]+\d*)?)(?![\w-])")
RESULTS_MAX_BYTES = 2_000_000  # the results a clone carries, kept small: raise it knowingly
REPO_DIRS = (".ci/", "bench/", "cli/", "docs/", "justfit/", "kvexec/", "phaseswap/", "statetrans/", "tests/")
PLACEHOLDERS = ("SUITE", "TIME", "NAME", "test_X", "*", "<", "{", "...")
# The README's first lines, byte for byte: CI (.ci/run) runs the test command.
FRESH_MACHINE = """# JustFit

```bash
./dev chat    # fresh machine: set everything up, then chat with the embedded SmolLM2-135M
./dev test    # fresh machine: set everything up, then run the whole test suite
```
"""
README_MAX_LINES = 210  # a page for users; measurements belong in docs/BENCHMARKS.md
PACKAGES = ("kvexec", "phaseswap", "statetrans", "justfit")  # justfit/server/, justfit/model/gguf/ included


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.name}: broken links {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_cited_paths_exist(doc: Path) -> None:
    missing = []
    for token in CODE.findall(doc.read_text()):
        token = token.rstrip(".,;:")
        if not token.startswith(REPO_DIRS) or any(p in token for p in PLACEHOLDERS):
            continue
        if not (ROOT / token).exists():
            missing.append(token)
    assert not missing, f"{doc.name} cites paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_cited_results_exist(doc: Path) -> None:
    saved = {p.name for p in RESULTS.iterdir()}
    missing = sorted({stem for stem in RESULT.findall(doc.read_text())
                      if not any(name.startswith(stem) for name in saved)})
    assert not missing, f"{doc.name} cites result files not in bench/results/: {missing}"


def test_results_kept_are_the_ones_the_docs_cite() -> None:
    """Every file in bench/results/ is cited by a doc (INDEX.md aside), INDEX.md lists
    them as `python -m bench.report` writes it, and the folder stays small."""
    from bench import results_index

    cited = {stem for doc in DOCS for stem in RESULT.findall(doc.read_text())}
    files = [p for p in RESULTS.iterdir() if p.is_file() and p.name != "INDEX.md"]
    uncited = sorted(p.name for p in files if p.name.split(".")[0] not in cited)
    assert not uncited, f"result files no doc cites (cite them or delete them): {uncited}"
    assert (RESULTS / "INDEX.md").read_text() == results_index.markdown(RESULTS), "run python -m bench.report"
    assert sum(p.stat().st_size for p in files) + (RESULTS / "INDEX.md").stat().st_size <= RESULTS_MAX_BYTES


def test_readme_keeps_the_fresh_machine_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith(FRESH_MACHINE)
    assert "exec ./dev test" in (ROOT / ".ci" / "run").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES


def test_slug_matches_github() -> None:
    assert _slug(" GGUF import: faithfulness against llama.cpp") == "gguf-import-faithfulness-against-llamacpp"
    assert _slug(" Serving: `justfit serve`") == "serving-justfit-serve"


def _undocumented(path: Path) -> list[str]:
    """The module, and its public top-level functions and classes and their public methods, that lack a docstring."""
    tree = ast.parse(path.read_text())
    where = path.relative_to(ROOT)
    out = [] if ast.get_docstring(tree) else [f"{where}: module"]
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if not isinstance(node, (*defs, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node):
            out.append(f"{where}:{node.lineno} {'class ' if isinstance(node, ast.ClassDef) else ''}{node.name}")
        if isinstance(node, ast.ClassDef):
            out += [f"{where}:{m.lineno} {node.name}.{m.name}" for m in node.body
                    if isinstance(m, defs) and not m.name.startswith("_") and not ast.get_docstring(m)]
    return out


def test_public_functions_have_docstrings() -> None:
    offenders = [o for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py")) for o in _undocumented(f)]
    assert not offenders, f"{len(offenders)} public definitions without a docstring:\n" + "\n".join(offenders)


def test_architecture_names_every_module() -> None:
    """docs/ARCHITECTURE.md describes the request path end to end: every module of the
    four packages appears in it by path."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(ROOT)) for pkg in ("justfit", "kvexec", "phaseswap", "statetrans")
               for p in sorted((ROOT / pkg).rglob("*.py")) if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in doc]
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"
