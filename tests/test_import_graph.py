"""The import graph of src/moekv: the allowed layer order of its folders, and no import cycles.

Walks every file with `ast` (nothing is imported). Every `import` / `from ... import` of a moekv
module counts as an edge, at module level or inside a function (a lazy import still runs the
imported code and still ties the two files together). Exceptions, each with its reason:

- `if TYPE_CHECKING:` blocks never run; they are left out.
- `from pkg import name` is an edge to the submodule `pkg.name` when that is a file, else to `pkg`.

The layer order (docs/architecture.md, "Layers"), bottom first. A top-level package or module may
import only from its own package and from packages of a lower layer; packages of one layer do not
import each other.
"""

from __future__ import annotations

import ast
import collections
import functools
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "moekv"

LAYERS: list[set[str]] = [
    {"errors", "version"},                                      # leaves: typed errors, the version string
    {"arch", "offload_config", "cache_config"},                 # the checkpoint architecture record, offload + KV switches
    {"envs"},                                                   # the one reader of environment variables
    {"paths"},                                                  # file locations (env overrides)
    {"config", "core", "tokenizer", "provenance", "datasets", "metrics"},   # config + plain records
    {"ops"},              # kernels: reference/ (PyTorch) and triton/, one dispatch point
    {"kvcache"},          # pages, block tables, page formats (calls ops)
    {"kv", "sampling", "structured"},   # researcher API over the page formats; the sampler; grammars
    {"layers"},           # model building blocks (attention, MoE block, experts seam), single-device
    {"models"},           # model assembly, registry, checkpoint loading
    {"moe"},              # what plugs into the experts seam from outside: offload + prefetch, load stats
    {"scheduler"},        # which requests run this step (never the engine)
    {"distributed"},      # process groups, exchange, placement, balancer, failure, sharding
    {"engine"},           # the step loop: schedule -> run -> sample
    {"entrypoints"},      # LLM, CLI generate, OpenAI server
    {"eval", "integrations", "bench", "testing"},   # testing: case builders for tests and benchmarks
    {"cli"},
    {"__main__", "moekv"},  # `python -m moekv`; the package's lazy public API (moekv.LLM, ...)
]

# Edges that break the layer order today, each removed by another helper's part of issue 18.
# Delete an entry when its edge is gone (the test fails on a stale entry, so the list only shrinks).
OPEN_LAYER_EDGES: dict[tuple[str, str], str] = {}

# File-level cycles open today, each removed by another helper's part (same rule as above).
OPEN_FILE_CYCLES: dict[frozenset[str], str] = {}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the moekv modules it imports (files; a package is its __init__.py)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    package = package[:len(package) - node.level + 1]
                    base = ".".join(package + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in files else base)
        graph[module] = {t for t in map(resolve, (t for t in targets if t.split(".")[0] == "moekv"))
                         if t is not None and t != module}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moekv"


def _layer_of() -> dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def test_every_top_level_package_has_a_layer():
    tops = {_top(m) for m in import_graph()}
    assert tops - set(_layer_of()) == set(), "add new top-level packages to LAYERS (and docs/architecture.md)"
    assert set(_layer_of()) - tops == set(), "LAYERS names a package that no longer exists"


def test_layer_order():
    layer = _layer_of()
    upward = {(a, b) for a, targets in import_graph().items() for b in targets
              if _top(a) != _top(b) and layer[_top(a)] <= layer[_top(b)]}
    assert sorted(upward - set(OPEN_LAYER_EDGES)) == [], "imports against the layer order (see LAYERS)"
    assert sorted(set(OPEN_LAYER_EDGES) - upward) == [], "an allow-listed edge is gone: delete its entry"


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_file_cycles():
    cycles = set(_cycles(import_graph()))
    assert sorted(map(sorted, cycles - set(OPEN_FILE_CYCLES))) == [], "import cycles between files"
    assert sorted(map(sorted, set(OPEN_FILE_CYCLES) - cycles)) == [], "an allow-listed cycle is gone: delete it"


def test_no_folder_cycles():
    """Between folders at every depth that do not contain each other (ops/reference vs ops/triton,
    layers vs moe); a folder and its own subfolders are one package here (the file test covers them)."""
    folder = {m: m if (SRC.parent / m.replace(".", "/") / "__init__.py").exists() else m.rpartition(".")[0]
              for m in import_graph()}
    folder_graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, targets in import_graph().items():
        for b in targets:
            fa, fb = folder[a], folder[b]
            if fa != fb and not fb.startswith(fa + ".") and not fa.startswith(fb + "."):
                folder_graph[fa].add(fb)
    assert sorted(map(sorted, _cycles(folder_graph))) == [], "import cycles between folders"
