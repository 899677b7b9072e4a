"""The dependency rules of the package, read from the source with ``ast`` (imports at any depth, inside functions
too, relative ones resolved; ``importlib.import_module`` / ``__import__`` of a constant name count as imports):

- the library (``tim_plugins/`` outside ``tim_plugins/apps/``) imports no adapter (``tim_plugins.integrations``),
  no framework (trl, verl, vllm) and no application;
- the adapters (``integrations/trl``, ``integrations/verl``, ``integrations/vllm``) never import each other, nor
  the applications;
- no import cycle among all of it (library, adapters, applications; ``integrations/`` imports as
  ``tim_plugins.integrations``, the pyproject ``package-dir`` mapping).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("trl", "verl", "vllm")
ADAPTERS = ("trl", "verl", "vllm")
# folder -> dotted package it is imported as
SOURCE_ROOTS = {ROOT / "tim_plugins": "tim_plugins", ROOT / "integrations": "tim_plugins.integrations"}


def _module_name(path: Path, root: Path, prefix: str) -> tuple[str, str]:
    """(module name, package that its relative imports start from) of a file under ``root``."""
    parts = path.relative_to(root).with_suffix("").parts
    is_init = parts[-1] == "__init__"
    name = ".".join([prefix, *(parts[:-1] if is_init else parts)])
    return name, name if is_init else name.rpartition(".")[0]


def imports_of(source: str, package: str, modules: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``: ``import a.b`` gives a.b, ``from a import b``
    gives a and a.b (b may be a module), relative imports are resolved against ``package``. With ``modules`` (the
    known module names), ``from a import b, c`` where every name is a submodule gives only a.b and a.c: the
    package ``a`` is only being initialised (``from . import _features`` inside a package's own module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            if modules is None or not names or any(n not in modules for n in names):
                found.append((node.lineno, base))
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def _modules() -> list[tuple[str, str, Path]]:
    """(module name, package, path) of every source file of the library, the applications and the adapters."""
    out = []
    for root, prefix in SOURCE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            if "examples" in path.relative_to(root).parts:  # scripts for users, not modules of the package
                continue
            name, package = _module_name(path, root, prefix)
            out.append((name, package, path))
    return out


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _library_violation(imported: str) -> str | None:
    if imported.split(".")[0] in FRAMEWORKS:
        return "a framework"
    if _under(imported, "tim_plugins.integrations"):
        return "an adapter"
    if _under(imported, "tim_plugins.apps"):
        return "an application"
    return None


def _adapter_violation(adapter: str, imported: str) -> str | None:
    for other in ADAPTERS:
        if other != adapter and _under(imported, f"tim_plugins.integrations.{other}"):
            return f"the {other} adapter"
    if _under(imported, "tim_plugins.apps"):
        return "an application"
    return None


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_the_scanner_finds_nested_relative_and_dynamic_imports():
    """The reader below the two rules: an import inside a function, relative imports that reach the adapters from
    a library subpackage, and import_module of a constant are all found and resolved."""
    source = (
        "import os\n"
        "def f():\n"
        "    from vllm import LLM\n"
        "    from ..integrations import trl\n"
        "    from ..integrations.verl.config import TIMVerlConfig\n"
        "class C:\n"
        "    def g(self):\n"
        "        import importlib\n"
        "        return importlib.import_module('trl.trainer')\n"
        "from .batch import RolloutBatch\n"
    )
    found = imports_of(source, "tim_plugins.rollout")
    assert (3, "vllm") in found and (3, "vllm.LLM") in found
    assert (4, "tim_plugins.integrations.trl") in found
    assert (5, "tim_plugins.integrations.verl.config") in found
    assert (9, "trl.trainer") in found
    assert (10, "tim_plugins.rollout.batch") in found
    flagged = sorted({line for line, name in found if _library_violation(name)})
    assert flagged == [3, 4, 5, 9]
    assert _adapter_violation("trl", "tim_plugins.integrations.verl.config") == "the verl adapter"
    assert _adapter_violation("trl", "tim_plugins.integrations.trl.hooks") is None
    assert _adapter_violation("trl", "vllm") is None  # TRL's colocated engine: a framework, not our adapter


def test_library_imports_no_adapter_no_framework_and_no_application():
    bad: dict[str, str] = {}  # file:line -> what it imports (the first name of the statement)
    for name, package, path in _modules():
        if _under(name, "tim_plugins.integrations") or _under(name, "tim_plugins.apps"):
            continue
        for line, imported in imports_of(path.read_text(), package):
            why = _library_violation(imported)
            if why:
                bad.setdefault(_where(path, line), f"imports {imported} ({why})")
    assert not bad, "the library must not import these (only tim_plugins/apps/ may):\n" + "\n".join(
        f"{where} {what}" for where, what in sorted(bad.items()))


def test_adapters_import_neither_each_other_nor_the_applications():
    bad: dict[str, str] = {}
    seen = set()
    for name, package, path in _modules():
        adapter = next((a for a in ADAPTERS if _under(name, f"tim_plugins.integrations.{a}")), None)
        if adapter is None:
            continue
        seen.add(adapter)
        for line, imported in imports_of(path.read_text(), package):
            why = _adapter_violation(adapter, imported)
            if why:
                bad.setdefault(_where(path, line), f"the {adapter} adapter imports {imported} ({why})")
    assert seen == set(ADAPTERS)
    assert not bad, "\n".join(f"{where}: {what}" for where, what in sorted(bad.items()))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> the modules it imports), as a path back to its start; None if none."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name, stack):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state and (found := visit(dep, [*stack, dep])):
                return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_the_cycle_finder_finds_a_deferred_cycle_and_not_a_package_face():
    source = {"p": "from .a import A\n", "p.a": "def f():\n    from p.b import B\n", "p.b": "from . import c\n",
              "p.c": "from .a import A\n"}
    packages = {"p": "p", "p.a": "p", "p.b": "p", "p.c": "p"}
    graph = {m: {d for _, d in imports_of(src, packages[m], set(source))} & set(source) - {m}
             for m, src in source.items()}
    assert graph["p.b"] == {"p.c"}  # `from . import c`: the submodule, not the package being initialised
    assert _cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    graph["p.c"] = set()
    assert _cycle(graph) is None


def test_no_import_cycle():
    """Imports among all modules of the package form no cycle, counting imports inside functions too (a deferred
    import that closes a cycle still ties the modules together)."""
    modules = _modules()
    names = {name for name, _, _ in modules}
    graph = {}
    for name, package, path in modules:
        graph[name] = {imported for _, imported in imports_of(path.read_text(), package, names)}
    graph = {name: {d for d in deps if d in graph and d != name} for name, deps in graph.items()}
    assert "tim_plugins.integrations.trl.callback" in graph and "tim_plugins.apps.cli" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
