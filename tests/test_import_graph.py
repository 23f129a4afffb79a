"""The package's import graph: no cycle, and Flower only in the engine and strategy layers.

The graph is built from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` statement of every module, at module level or inside a function, class,
``if TYPE_CHECKING`` block or ``try``. ``import a.b.c`` depends on the module ``a.b.c``;
``from a.b import c`` on ``a.b.c`` when that is a module, else on ``a.b``. The import
package is ``fedhier``: the core in ``fedhier/``, and Flower's ServerApp and ClientApp side
``fedhier.strategies`` and ``fedhier.clients`` (the "Flower layer") and the dataset cards
``fedhier.datasets_cfg`` in the root folders ``strategies/``, ``clients/`` and
``datasets_cfg/``; the last release's names ``fedhier_strategies`` and ``fedhier_clients``
are two small forwarding packages inside those folders.

Imports through ``importlib`` (the engine registry's ``"module:function"`` strings) are not
statements and are not edges: that is how the registry names engines without importing them.
"Flower" here is the ``flwr`` package; ``flwr_datasets`` (the partitioners in fedhier/data/) is
a separate package and may be imported anywhere.

``python tests/test_import_graph.py`` prints every cycle found, then runs these tests.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Installed package name -> source folder.
PACKAGES = {"fedhier": ROOT / "fedhier", "fedhier.strategies": ROOT / "strategies",
            "fedhier.clients": ROOT / "clients", "fedhier.datasets_cfg": ROOT / "datasets_cfg",
            "fedhier_strategies": ROOT / "strategies" / "deprecated_fedhier_strategies",
            "fedhier_clients": ROOT / "clients" / "deprecated_fedhier_clients"}
#: The layers above the core (Flower's app components); core modules must not reach them,
#: not even by a module name in a string for ``importlib`` (hidden from the import graph).
UPPER_LAYERS = ("fedhier.strategies", "fedhier.clients", "fedhier_strategies",
                "fedhier_clients")
#: Where ``flwr`` may be imported: the engine layer and Flower's own app components.
FLOWER_LAYERS = ("fedhier.engines", *UPPER_LAYERS)
#: Modules outside those layers that still import flwr, each with the reason it is allowed.
FLOWER_ALLOWED: dict[str, str] = {}


def modules(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Every module of the installed package fedhier, by dotted name."""
    found: dict[str, Path] = {}
    roots = set(packages.values())
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            if any(root != folder and root in path.parents for root in roots
                   if folder in root.parents):
                continue  # a folder inside this one is a package of its own
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if name in found:  # two folders giving one module name
                raise AssertionError(f"{name} is both {found[name]} and {path}")
            found[name] = path
    return found


def imported_names(name: str, path: Path) -> Iterator[tuple[str, int, str | None]]:
    """(module, line, imported attribute or None) for each import in ``path``."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[:len(base) - drop] if drop else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                yield source, node.lineno, alias.name


def import_graph(packages: dict[str, Path] = PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {fedhier module it imports: first line}."""
    known = modules(packages)
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        for source, line, attribute in imported_names(name, path):
            target = f"{source}.{attribute}" if attribute else source
            if target not in known:
                target = source
            if target in known and target != name:
                edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The shortest cycle through each module that lies on one, without repeats.

    The modules on cycles are the strongly connected components of more than one module
    (Tarjan); a cycle is listed from its alphabetically first module.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles: set[tuple[str, ...]] = set()
    for component in components:
        for start in component:
            cycle = shortest_cycle(graph, component, start)[:-1]
            first = cycle.index(min(cycle))
            cycles.add((*cycle[first:], *cycle[:first]))
    return [[*c, c[0]] for c in sorted(cycles)]


def shortest_cycle(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """``a (line 3) -> b (line 9) -> a``: each module with the line of its import of the next."""
    steps = [f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join([*steps, cycle[-1]])


def test_the_graph_sees_every_kind_of_import(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "extra").mkdir()
    files = {
        "pkg/__init__.py": "from pkg.sub import leaf  # re-export\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "import os\nfrom . import sibling\nfrom ..top import VALUE\n",
        "pkg/sub/sibling.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    import pkg.top\n",
        "pkg/top.py": "def f():\n    from pkg.extra.app import run\n    import pkg.sub.leaf\n",
        "extra/__init__.py": "", "extra/app.py": "from pkg import top\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = import_graph({"pkg": tmp_path / "pkg", "pkg.extra": tmp_path / "extra"})
    assert graph == {
        "pkg": {"pkg.sub.leaf": 1},                      # from a.b import module
        "pkg.sub": {},
        "pkg.sub.leaf": {"pkg.sub.sibling": 2, "pkg.top": 3},  # relative imports
        "pkg.sub.sibling": {"pkg.top": 3},               # under TYPE_CHECKING
        "pkg.top": {"pkg.extra.app": 2, "pkg.sub.leaf": 3},  # inside a function
        "pkg.extra": {}, "pkg.extra.app": {"pkg.top": 1},  # a folder mapped into pkg
    }
    assert find_cycles(graph) == [["pkg.extra.app", "pkg.top", "pkg.extra.app"],
                                  ["pkg.sub.leaf", "pkg.sub.sibling", "pkg.top",
                                   "pkg.sub.leaf"],
                                  ["pkg.sub.leaf", "pkg.top", "pkg.sub.leaf"]]


def test_the_package_graph_covers_the_three_packages():
    graph = import_graph()
    assert {"fedhier.cli.commands", "fedhier.strategies.server_app", "fedhier.clients.app",
            "fedhier.strategies.edge.server", "fedhier.datasets_cfg",
            "fedhier.engines.deployment.cli"} <= graph.keys()
    # a function-level import
    assert "fedhier.engines.deployment.cli" in graph["fedhier.cli.commands"]


def test_find_cycles_reports_a_cycle_through_a_function_level_import():
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 2}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    two = {"a": {"b": 1}, "b": {"a": 2, "c": 5}, "c": {"b": 4}}
    assert find_cycles(two) == [["a", "b", "a"], ["b", "c", "b"]]
    assert describe(graph, ["a", "b", "c", "a"]) == "a (line 1) -> b (line 3) -> c (line 7) -> a"
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(describe(graph, c) for c in cycles)


def test_flower_is_imported_only_by_the_engine_and_strategy_layers():
    offenders = {}
    for name, path in modules().items():
        if name.startswith(FLOWER_LAYERS) or name in FLOWER_ALLOWED:
            continue
        lines = [line for source, line, _ in imported_names(name, path)
                 if source == "flwr" or source.startswith("flwr.")]
        if lines:
            offenders[name] = lines
    assert not offenders, f"flwr imported outside the engine/strategy layers: {offenders}"


def test_the_flower_allow_list_is_not_stale():
    known = modules()
    for name in FLOWER_ALLOWED:
        assert name in known, f"{name} no longer exists: drop it from FLOWER_ALLOWED"
        assert any(s == "flwr" or s.startswith("flwr.")
                   for s, _, _ in imported_names(name, known[name])), \
            f"{name} no longer imports flwr: drop it from FLOWER_ALLOWED"


#: Where else the three packages are imported from (checked for names that are no module).
USERS = ("tests", "benchmarks", "scripts", "examples")


def is_core(name: str) -> bool:
    """A module of the core: fedhier outside its engine layer."""
    return (name == "fedhier" or name.startswith("fedhier.")) \
        and not name.startswith(("fedhier.engines", *UPPER_LAYERS))


def unknown_imports(known: dict[str, Path], name: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import in ``path`` of one of the three packages' names that is
    no module of theirs, e.g. ``fedhier.strategies.cloud_step`` (the Flower layer's name
    before it had its own): no edge in the graph, so it would hide a cycle or a layer breach,
    and a venv holding an old editable install may still resolve it to other files."""
    found = []
    for source, line, attribute in imported_names(name, path):
        if source.split(".")[0] not in PACKAGES:
            continue
        target = f"{source}.{attribute}" if attribute else source
        if target not in known and source not in known:
            found.append((line, target))
    return found


def test_unknown_imports_are_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import fedhier.round.loop\nfrom fedhier.settings.run_config import RunConfig\n"
                    "from fedhier.hsgd import HierarchicalSGD\n"
                    "from fedhier.clients import app\nimport os.path\n"
                    "import fedhier.clients.nothing_here\n")
    # fedhier.hsgd is the last release's name (it still imports, with a warning): code here
    # uses today's names
    assert unknown_imports(modules(), "m", path) == [
        (3, "fedhier.hsgd.HierarchicalSGD"), (6, "fedhier.clients.nothing_here")]


def test_every_import_of_the_packages_names_one_of_their_modules():
    known = modules()
    offenders = {str(path.relative_to(ROOT)): found
                 for name, path in known.items() if (found := unknown_imports(known, name, path))}
    for folder in USERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if found := unknown_imports(known, path.stem, path):
                offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"imports of names that are no module: {offenders}"


def test_the_core_imports_nothing_of_the_flower_layer():
    """fedhier outside fedhier.engines runs without Flower's ServerApp and ClientApp side."""
    flower = {name: sorted(t for t in edges if t.startswith(UPPER_LAYERS))
              for name, edges in import_graph().items() if is_core(name)}
    offenders = {n: f for n, f in flower.items() if f}
    assert not offenders, f"the core imports the Flower layer: {offenders}"


def test_the_client_side_needs_no_server_side():
    """A SuperNode imports fedhier.clients and the core only: not the strategies, not the
    engines (the ServerApp side imports the client side's record codec, not the reverse)."""
    offenders = {name: sorted(t for t in edges
                              if t.startswith(("fedhier.strategies", "fedhier.engines")))
                 for name, edges in import_graph().items() if name.startswith("fedhier.clients")}
    assert not {n: f for n, f in offenders.items() if f}, offenders


def test_no_package_edits_its_import_path():
    """The three packages are plain folders: nothing appends to a ``__path__`` at import time
    (the source tree, the FAB, the editable install and the wheel import the same files)."""
    edits = [name for name, path in modules().items() if "__path__" in path.read_text()]
    assert not edits, f"modules touching __path__: {edits}"


def upper_layer_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each string constant in ``path`` that names a module of the upper
    layers (``fedhier.strategies.x`` or ``fedhier.strategies.x:function``); docstrings, which
    mention modules in prose, are whole sentences and never match."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.split(":")[0]
            if any(name == layer or name.startswith(layer + ".") for layer in UPPER_LAYERS) \
                    and name.replace(".", "").replace("_", "").isalnum():
                found.append((node.lineno, node.value))
    return found


def test_upper_layer_strings_are_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""See fedhier.strategies.cloud_step for more."""\nimport importlib\n'
                    'importlib.import_module("fedhier.strategies.cloud_step")\n'
                    'X = ("fedhier.clients.app:app", "fedhier.tree.hierarchy")\n')
    assert upper_layer_strings(path) == [(3, "fedhier.strategies.cloud_step"),
                                         (4, "fedhier.clients.app:app")]


#: Core modules whose strings name upper-layer modules, each with the reason.
NAMES_TABLES = {"fedhier.common.import_names": "the table of import names: where each one's "
                "files are and the last release's names; it imports one only when asked for it"}


def test_the_core_names_no_upper_layer_module_in_a_string():
    """The checkpoint reader (fedhier.runs.state_codec) once imported the strategy layer by name;
    the strategy layer now registers its classes itself."""
    offenders = {name: upper_layer_strings(path) for name, path in modules().items()
                 if not name.startswith((*UPPER_LAYERS, "fedhier.engines"))
                 and name not in NAMES_TABLES}
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, f"core modules naming upper-layer modules: {offenders}"
    assert not upper_layer_strings(modules()["fedhier.runs.state_codec"])


if __name__ == "__main__":  # python tests/test_import_graph.py: print the cycles
    g = import_graph()
    for c in find_cycles(g):
        print(describe(g, c))
    pytest.main([__file__, "-q"])
