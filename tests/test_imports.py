"""Imports go one way: verbs (the CLI's modules) on top, importing no other verb; below them the
packages, with no cycle between them, so each can be read knowing only what it imports."""

import ast
import graphlib
from pathlib import Path

from moejax.cli import VERB_MODULES

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moejax", "sharding", "pallas_kernels", "checkpoints")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for top in PACKAGES for p in (ROOT / top).rglob("*.py")}


def imports(module: str) -> set[str]:
    """The project's modules `module` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import module` imports the module; `from module import name`, the module
            names = [m for m in (f"{node.module}.{a.name}" for a in node.names) if m in MODULES] or [node.module]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def unit(module: str) -> str:
    """The node of the package graph a module belongs to: a verb, a folder of moejax (a layer:
    `base`, `launch`, `engine`, ...), a module at moejax's top (`cli`, `__main__`, the package's
    own `__init__`), or a top-level package."""
    if module in VERB_MODULES or module == "moejax.cli":
        return module
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "moejax" and len(parts) > 1 else parts[0]


GRAPH = {m: imports(m) for m in MODULES}


def test_every_verb_module_exists():
    assert set(VERB_MODULES) <= set(MODULES)


def test_verbs_are_imported_by_the_cli_only():
    wrong = sorted((m, v) for m, deps in GRAPH.items() for v in deps & set(VERB_MODULES) if m != "moejax.cli")
    assert not wrong, f"modules importing a verb module: {wrong}"


def package(module: str) -> str:
    """The package a module lies in, verbs included (`moejax.serving.commands`: moejax.serving)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "moejax" and len(parts) > 1 else parts[0]


def test_the_package_graph_has_no_cycle():
    """The verbs sit above every package (`unit`), so a package's verb importing what imports that
    package back is no cycle here: `test_no_package_imports_back_a_package_whose_verb_imports_it`."""
    graph = {}
    for m, deps in GRAPH.items():
        graph.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) != unit(m))
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


# The one loop inside a package: the schema's default model is a preset, and presets are made of the
# schema's classes (the schema imports them inside a function).
LOOPS = {("moejax.config.schema", "moejax.config.presets")}


def test_no_package_holds_an_import_cycle():
    """Inside a package (each folder of moejax too) the modules import one another one way as well,
    so a folder hides no cycle between the modules it groups."""
    for p in {package(m) for m in MODULES}:
        inside = {
            m: {d for d in GRAPH[m] if package(d) == p and (m, d) not in LOOPS} for m in MODULES if package(m) == p
        }
        graphlib.TopologicalSorter(inside).prepare()  # raises CycleError naming the cycle


def test_no_package_imports_back_a_package_whose_verb_imports_it():
    """A verb module in a package (serving's `commands`) imports packages below; none of those imports
    that package back (serve's verb importing analysis' ranking, which imported serving's types: each
    package imported the other)."""
    back = sorted(
        (verb, m, d)
        for verb in VERB_MODULES
        for below in {package(d) for d in GRAPH[verb]} - {package(verb)}
        for m in MODULES
        if package(m) == below and m not in VERB_MODULES
        for d in GRAPH[m]
        if package(d) == package(verb) != verb and d not in VERB_MODULES
    )
    assert not back, f"(verb, module importing its package back, what it imports): {back}"


def test_the_trace_format_sits_below_the_engine_and_serving():
    assert GRAPH["moejax.base.trace"] <= {"moejax.base.errors"}


def test_the_kernels_import_nothing_of_moejax_but_its_vocabulary():
    """pallas_kernels sits below moejax: its kernels know the run only by the words of `moejax.vocab`."""
    found = {d for m, deps in GRAPH.items() if m.startswith("pallas_kernels") for d in deps if d.startswith("moejax")}
    assert found == {"moejax.vocab"}
