"""The package's layout: steps import only downward, no module imports itself round a cycle, the
planner loads no torch, and the command line's listing loads no subcommand."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autopipe"

#: Each step of the flow and what it may import: its own rank or lower.  Shared top-level modules
#: sit below every step; the entry points that combine steps (``partition``, ``bench``) above runtime.
RANKS = {
    "_jsonio": 0, "_allocator": 0, "_vocab": 0, "_checks": 0, "device": 0, "errors": 0, "timeline": 0,
    "model": 1, "profiling": 2, "planning": 3, "runtime": 4,
    "_partition": 5, "bench": 5, "distributed": 6, "cli": 7,
    "__init__": 8, "__main__": 8,
}


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere (top level, functions, TYPE_CHECKING):
    ``from .x import y`` counts ``x.y`` when that is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def step(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_step() -> None:
    assert {step(name) for name in module_names()} <= set(RANKS)


def test_steps_import_only_downward() -> None:
    upward = sorted(f"{name} -> {target}" for name, targets in graph().items() for target in targets
                    if RANKS[step(name)] < RANKS[step(target)])
    assert upward == []


def test_no_import_cycle() -> None:
    edges = graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_walk_sees_known_edges() -> None:
    """The walk itself: relative imports, ``from . import module`` and function-level imports resolve."""
    edges = graph()
    assert "autopipe.planning.candidates" in edges["autopipe.planning.completion"]
    assert "autopipe.planning.interleaved" in edges["autopipe.planning.solver"]
    assert "autopipe.profiling.profiles" in edges["autopipe.planning.cost"]
    assert "autopipe.device" in edges["autopipe.planning._options"]  # inside a function


def _fresh(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=PACKAGE.parent, check=True)
    return result.stdout.strip()


def test_planning_loads_no_torch() -> None:
    loaded = _fresh("import sys, autopipe.planning, autopipe.profiling; "
                    "from autopipe.planning import plan, Plan; from autopipe.profiling import Profile; "
                    "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert loaded == "[]"


def test_cli_listing_loads_no_subcommand_and_no_torch() -> None:
    loaded = _fresh("import sys, contextlib, io\n"
                    "from autopipe.cli import main\n"
                    "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
                    "    main(['--help'])\n"
                    "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('autopipe.cli.')))")
    assert loaded == "[]"


@pytest.mark.parametrize("command", [pytest.param("profile", marks=pytest.mark.slow), "show",
                                     pytest.param("demo", marks=pytest.mark.slow)])
def test_each_subcommand_still_explains_itself(command: str) -> None:
    result = subprocess.run([sys.executable, "-m", "autopipe", command, "--help"], capture_output=True,
                            text=True, timeout=120, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert f"usage: python -m autopipe {command}" in result.stdout and "--" in result.stdout
