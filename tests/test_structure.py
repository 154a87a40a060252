"""The package stays a one-way stack: no import cycles (function-level imports count), no private name
imported across modules, every module small and opening with a docstring that says its job; and no
tracked .py file of the repository has a line longer than 120 characters.

Read from the source with `ast`, so a change that breaks the structure fails here before review.
"""

import ast
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_varrate"
MAX_LINES = 350
REPO = PACKAGE.parent
MAX_LINE_LENGTH = 120


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every `import` / `from ... import` of this package, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            found.append((target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return [(target, names) for target, names in found if target.split(".")[0] == "hf_varrate"]


def graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a `from pkg import name` of a submodule counts as that module)."""
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = set()
        for target, names in imports(name, path):
            targets.update(f"{target}.{n}" for n in names if f"{target}.{n}" in known)
            if target in known and not all(f"{target}.{n}" in known for n in names):
                targets.add(target)
        edges[name] = targets - {name}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph `edges` as the list of its nodes (first repeated last), or None."""
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return [*trail[trail.index(nxt):], nxt] if nxt in trail else [node, nxt]
            if nxt not in state:
                found = visit(nxt, [*trail, nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    edges = graph()
    face = sorted(name for name, targets in edges.items() if "hf_varrate" in targets)
    assert not face, f"modules importing the package face hf_varrate/__init__ (which imports them all): {face}"
    assert find_cycle({k: v for k, v in edges.items() if k != "hf_varrate"}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail


def test_no_private_name_is_imported_across_modules():
    offenders = [f"{name}: {target}.{n}" for name, path in modules().items() for target, names in imports(name, path)
                 for n in names if n.startswith("_") and not n.startswith("__")]
    assert not offenders, f"private names imported across modules: {offenders}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_is_small_and_says_its_job(name):
    path = modules()[name]
    source = path.read_text()
    assert ast.get_docstring(ast.parse(source)), f"{path} opens with no docstring"
    assert source.count("\n") <= MAX_LINES, f"{path} has {source.count(chr(10))} lines (> {MAX_LINES})"


def test_the_codec_imports_nothing_above_it():
    """The codec is pure tensor functions: besides itself, only the bottom of the stack."""
    allowed = {"hf_varrate.config", "hf_varrate.signals", "hf_varrate.architecture", "hf_varrate.paths",
               "hf_varrate.errors"}
    above = {f"{name} -> {target}" for name, targets in graph().items() if name.startswith("hf_varrate.codec")
             for target in targets if not target.startswith("hf_varrate.codec") and target not in allowed}
    assert not above, f"the codec reaches up: {sorted(above)}"


def tracked_sources() -> list[Path]:
    """Every .py file git tracks in the repository; without git, every one under it outside .git and .venv*."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = []
    if any(listed):
        return [REPO / name for name in listed if name and (REPO / name).is_file()]
    return sorted(path for path in REPO.rglob("*.py")
                  if not any(part == ".git" or part.startswith(".venv") for part in path.relative_to(REPO).parts))


def long_lines(name: str, source: str) -> list[str]:
    """`name:line (length)` for each line of `source` longer than MAX_LINE_LENGTH characters."""
    lines = (line.rstrip("\r") for line in source.split("\n"))
    return [f"{name}:{number} ({len(line)})" for number, line in enumerate(lines, 1) if len(line) > MAX_LINE_LENGTH]


def test_no_source_line_is_longer_than_120_characters():
    sources = tracked_sources()
    assert any(path.name == "test_structure.py" for path in sources), "no tracked .py file found"
    offenders = [hit for path in sources
                 for hit in long_lines(path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8"))]
    assert not offenders, f"{len(offenders)} lines over {MAX_LINE_LENGTH} characters: {offenders}"
    assert long_lines("x.py", "ok\n" + "x" * 121) == ["x.py:2 (121)"]  # the check can fail
