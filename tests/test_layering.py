"""The import layering of the two packages, read from the source (no import runs):

    flash_kernels  <-  flash_models.config, .modules  <-  .runtime  <-  flash_models.models  <-  registry, checkpoint
                   <-  generation, train, bench, cli, ...

A module may import its own layer or a lower one. Imports at module level must not form a cycle; imports
inside a function are checked for direction only, and an upward one is allowed only where it is listed
below as one of the HF-style entry points that live on a model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flash_models", "flash_kernels")

# Lowest first. A module belongs to the layer of the longest prefix that names it; a new module in none fails
# test_every_module_has_a_layer until it is placed.
LAYERS: list[tuple[str, ...]] = [
    ("flash_kernels",),
    ("flash_models._lazy", "flash_models.config", "flash_models.modules", "flash_models.backward"),
    ("flash_models.runtime",),
    ("flash_models.models",),
    ("flash_models.registry", "flash_models.checkpoint"),
    ("flash_models.generation", "flash_models.train", "flash_models.bench", "flash_models.cli", "flash_models.cli_source",
     "flash_models.compare", "flash_models.convert", "flash_models.embedded", "flash_models.hf", "flash_models.testing",
     "flash_models.__main__"),
]
TOP = "flash_models"  # the package's __init__: the public API, above everything

# (importing module, imported module): upward imports made inside a function, on purpose. Each is an HF-style
# method a user calls on a model (``model.generate``, ``model.save_pretrained``), kept on the model because
# transformers users expect it there; the work lives in the higher layer.
UPWARD_ENTRY_POINTS = {
    ("flash_models.models.decoder", "flash_models.generation"): "DecoderLM.generate",
    ("flash_models.models.decoder", "flash_models.checkpoint"): "DecoderLM.save_pretrained",
    ("flash_models.models.pretrained", "flash_models.checkpoint"): "PretrainedModel.save_pretrained",
    ("flash_models.models.hf_protocol", "flash_models.checkpoint"): "Model.from_pretrained, load_state_dict of HF's layout",
    ("flash_models.models.hf_protocol", "flash_models.registry"): "load_state_dict of HF's layout (the family's rules)",
    ("flash_models.models.hf_config", "flash_models.checkpoint"): "ModelConfig.from_pretrained (PEFT reads a base config)",
}


# Modules that must not import transformers when they are imported (it takes most of a second): everything up
# to the registry names HF classes by string and imports transformers inside the function that needs it.
NO_TRANSFORMERS_AT_IMPORT = ("flash_kernels", "flash_models.config", "flash_models.modules", "flash_models.runtime",
                             "flash_models.models", "flash_models.registry", "flash_models.generation")


def module_files() -> dict[str, Path]:
    files = {}
    for package_dir in (ROOT / "flash_models", ROOT / "kernels" / "flash_kernels"):
        base = package_dir.parent
        for path in package_dir.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def layer_of(module: str) -> int:
    if module == TOP:
        return len(LAYERS) - 1
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported project module, at module level?) for every import statement of ``module``. ``from a import
    b`` counts as an import of ``a.b`` when that is a module, else of ``a``. Imports under
    ``if TYPE_CHECKING:`` are not executed and are skipped."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []

    def visit(node, top: bool):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, top))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, top))
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return found


@pytest.fixture(scope="module")
def all_imports():
    files = module_files()
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


@pytest.fixture(scope="module")
def graph(all_imports):
    """Imports of our own modules only."""
    return {module: [(name, top) for name, top in imports if name.split(".")[0] in PACKAGES]
            for module, imports in all_imports.items()}


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_no_lower_layer_imports_a_higher_one(graph):
    wrong = set()
    for module, imports in graph.items():
        for target, top in imports:
            if layer_of(target) <= layer_of(module):
                continue
            if top or not _is_entry_point(module, target):
                wrong.add(f"{module} imports {target} ({'module level' if top else 'in a function'})")
    assert not wrong, "imports against the layering:\n  " + "\n  ".join(sorted(wrong))


def test_upward_entry_points_are_still_needed(graph):
    """An exception nobody uses any more is removed from the list, so the list stays the truth."""
    used = {(src, dst) for src, dst in UPWARD_ENTRY_POINTS
            for target, top in graph.get(src, []) if not top and (target == dst or target.startswith(dst + "."))}
    assert used == set(UPWARD_ENTRY_POINTS), sorted(set(UPWARD_ENTRY_POINTS) - used)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return out


def _is_entry_point(module: str, target: str) -> bool:
    return any(module == src and (target == dst or target.startswith(dst + ".")) for src, dst in UPWARD_ENTRY_POINTS)


def test_no_import_cycle(graph):
    """Every import counts, at module level or inside a function (a function-level import only hides a
    cycle until the function runs), except the listed entry points. A package's ``__init__`` importing its
    submodules counts too."""
    edges = {module: {t for t, _ in imports if t in graph and t != module and not _is_entry_point(module, t)}
             for module, imports in graph.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_lower_layers_do_not_import_transformers_at_import_time(all_imports):
    wrong = sorted({module for module, imports in all_imports.items()
                    if module.startswith(NO_TRANSFORMERS_AT_IMPORT)
                    and any(top and name.split(".")[0] == "transformers" for name, top in imports)})
    assert not wrong, f"import transformers inside the functions that need it: {wrong}"
