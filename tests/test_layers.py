"""The package layering of docs/architecture.md, read from every import in afd (those inside functions too):
no import points up a layer, no module imports itself back through others, no Python module passes 400
lines. A canary checks that the reader sees an import inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "afd"

#: bottom to top; a package may import its own layer's packages and any below, never above
LAYERS = [
    {"afd", "afd.config", "afd.types", "afd.env"},
    {"afd.kernels", "afd.models", "afd.kvcache", "afd.obs", "afd.testing"},
    {"afd.connectors", "afd.distributed", "afd.microbatch"},
    {"afd.engine"},
    {"afd.attention", "afd.ffn"},
    {"afd.runtime"},
    {"afd.serving"},
    {"afd.cli"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Every afd module ``module`` imports, at any depth of its code (not under ``if TYPE_CHECKING:``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "afd")
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "afd":
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # ``from afd import env`` imports afd.env
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = imports_of(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_the_reader_sees_imports_inside_functions():
    src = "def f():\n    from afd.serving.frontend import Frontend\n    import afd.cli.main\n"
    assert imports_of(src, "afd.engine.x", False) >= {"afd.serving.frontend", "afd.cli.main"}
    assert imports_of("if TYPE_CHECKING:\n    import afd.cli\n", "afd.engine.x", False) == set()


def test_no_import_points_up_a_layer():
    upward = []
    for module, targets in _graph().items():
        here = LAYER_OF.get(package_of(module))
        assert here is not None, f"{module}: its package {package_of(module)} has no layer in this test (and in docs/architecture.md)"
        for t in targets:
            there = LAYER_OF[package_of(t)]
            if there > here:
                upward.append(f"{module} -> {t}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    cycles = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                walk(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_passes_400_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {n} lines (at most {MAX_LINES}: split it by idea)"
