"""The package's shape, checked with ``ast`` (docs/architecture.md): imports run one way through the layers, no
import cycle, no module imports another module's private name, no file over 450 lines, no function over 60, and the
pure cores import neither Transformers nor anything above them.

Imports inside ``if TYPE_CHECKING:`` blocks are annotations only (never executed) and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_accel"

#: layer of each top-level part of the package: a module may import its own layer's and lower layers' modules
LAYERS = {
    "core": 0,
    "kernels": 1,
    "fused": 2,
    "quant": 2,
    "paged": 2,
    "native": 3,  # the executor reads the fused and int8 modules it runs
    "compile": 4,
    "speculative": 4,
    "engine": 5,
}
TOP = 6  # hf_accel/__init__.py, patch.py, generate.py, checkpoint.py, cli.py, bench.py, demo.py, models.py, errors.py

#: pure cores: no transformers, nothing of hf_accel outside core (and their own package's pure siblings)
PURE = {
    "hf_accel.paged.blocks": {"hf_accel.paged.prefix"},
    "hf_accel.paged.prefix": set(),
    "hf_accel.paged.plan": {"hf_accel.paged.blocks", "hf_accel.kernels.reference"},
    "hf_accel.engine.scheduler": {"hf_accel.paged.blocks"},
    "hf_accel.speculative.verify": set(),
    "hf_accel.speculative.policy": set(),
    "hf_accel.speculative.screen": set(),
    "hf_accel.quant.core": {"hf_accel.kernels.reference"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _imports(name: str) -> list[tuple[str, str | None]]:
    """``(imported module, imported name or None)`` of every runtime import in module ``name`` (lazy ones too)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full, None) if full in MODULES else (base, alias.name))
    return out


def _layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 and parts[1] in LAYERS else TOP


def _graph() -> dict[str, set[str]]:
    return {name: {mod for mod, _ in _imports(name) if mod in MODULES and mod != name} for name in MODULES}


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_imports_run_down_the_layers():
    bad = []
    for name, deps in _graph().items():
        for dep in deps:
            if _layer(dep) > _layer(name):
                bad.append(f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_private_names_imported_across_modules():
    bad = [
        f"{name} imports {mod}.{item}"
        for name in MODULES
        for mod, item in _imports(name)
        if item is not None and item.startswith("_") and mod.startswith("hf_accel") and mod != name
    ]
    assert not bad, "\n".join(sorted(bad))


@pytest.mark.parametrize("name", sorted(PURE))
def test_pure_cores_import_neither_transformers_nor_layers_above(name):
    for mod, _ in _imports(name):
        assert not mod.startswith("transformers"), f"{name} imports {mod}"
        if mod.startswith("hf_accel") and mod != name:
            assert mod.startswith("hf_accel.core") or mod in PURE[name], f"{name} imports {mod}"


def test_file_and_function_sizes():
    too_long = []
    for path in MODULES.values():
        source = path.read_text()
        lines = source.count("\n")
        if lines > 450:
            too_long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    too_long.append(f"{path.relative_to(PACKAGE.parent)}: {node.name} is {length} lines")
    assert not too_long, "\n".join(too_long)
