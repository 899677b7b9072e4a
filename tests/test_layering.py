"""The dependency rules of the package, read from the source with ``ast`` (imports at any depth, inside functions
too, relative ones resolved; ``importlib.import_module`` / ``__import__`` of a constant name count as imports):

- no module of ``tim_plugins/`` (the library and the applications) imports a framework (transformers, trl, verl,
  vllm, ray) at import time: importing the core, or running ``tim-plugins --help``, needs none of them;
- the library (``tim_plugins/`` outside ``tim_plugins/apps/``) imports no adapter (``tim_plugins.integrations``), no
  application, and no framework even inside a function, with one exception: inside a function it may take public
  names from ``transformers`` itself (``from transformers import AutoModelForCausalLM``: the toy and SmolLM2 model
  builders), never a submodule nor a private name;
- no module of ``tim_plugins/`` names a framework internal that an adapter registry lists (a private attribute of
  ``TRANSFORMERS_SOURCES``, ``VLLM_SOURCES``, ``VERL_SOURCES`` or ``TRL_SOURCES``, read, set or passed to
  getattr/setattr/vars as a string), and the library reads no attribute of a live vLLM engine: code that patches or
  reads a framework's internals lives in the adapters (#38);
- the adapters (``integrations/hf``, ``integrations/trl``, ``integrations/verl``, ``integrations/vllm``) never
  import the applications, nor each other, except that the trainer adapters (trl, verl) may import the engine
  adapters (hf, vllm) whose engines they drive;
- no import cycle among all of it (library, adapters, applications; ``integrations/`` imports as
  ``tim_plugins.integrations``, the pyproject ``package-dir`` mapping).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from functools import cache
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("ray", "transformers", "trl", "verl", "vllm")
# The framework whose public top-level names the library may import inside a function (never at import time).
PUBLIC_INSIDE_FUNCTIONS = "transformers"
ADAPTERS = ("hf", "trl", "verl", "vllm")
# adapter -> the adapters it may import: the trainer adapters drive the engines of the engine adapters (TRL generates
# with a transformers model or a colocated vLLM engine); the engine adapters import none.
ADAPTER_IMPORTS = {"hf": (), "vllm": (), "trl": ("hf", "vllm"), "verl": ("hf", "vllm")}
# The registries of the framework internals the adapters use (each file imports no framework).
REGISTRIES = {
    "TRANSFORMERS_SOURCES": ROOT / "integrations" / "hf" / "sources.py",
    "VLLM_SOURCES": ROOT / "integrations" / "vllm" / "sources.py",
    "VERL_SOURCES": ROOT / "integrations" / "verl" / "sources.py",
    "TRL_SOURCES": ROOT / "integrations" / "trl" / "hooks.py",
}
# Attributes of a live vLLM engine that are public in Python but internal to vLLM (its resolved configuration, its
# workers' model runner): only the vLLM adapter reads them (integrations/vllm/parity_spec.py). The applications drive
# their own engines and may.
VLLM_ENGINE_ATTRIBUTES = ("llm_engine", "vllm_config", "model_runner", "attn_groups")
# folder -> dotted package it is imported as
SOURCE_ROOTS = {ROOT / "tim_plugins": "tim_plugins", ROOT / "integrations": "tim_plugins.integrations"}


def _module_name(path: Path, root: Path, prefix: str) -> tuple[str, str]:
    """(module name, package that its relative imports start from) of a file under ``root``."""
    parts = path.relative_to(root).with_suffix("").parts
    is_init = parts[-1] == "__init__"
    name = ".".join([prefix, *(parts[:-1] if is_init else parts)])
    return name, name if is_init else name.rpartition(".")[0]


def _import_nodes(tree: ast.AST):
    """(node, deferred) of every import statement and ``import_module`` / ``__import__`` call of a constant name in
    ``tree``; deferred: inside a function or lambda (run when it is called, not when the module is imported)."""
    def walk(node, deferred):
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and getattr(child, "module", None) != "__future__":
                yield child, inner
            elif isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant) \
                    and isinstance(child.args[0].value, str):
                func = child.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called in ("import_module", "__import__"):
                    yield child, inner
            yield from walk(child, inner)

    yield from walk(tree, False)


def _resolve(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return base


def _names_of(node, package: str, modules: set[str] | None) -> list[str]:
    """Absolute module names one import node imports (see `imports_of`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.Call):
        return [node.args[0].value]
    base = _resolve(node, package)
    names = [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    found = [base] if modules is None or not names or any(n not in modules for n in names) else []
    return found + names


def imports_of(source: str, package: str, modules: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``: ``import a.b`` gives a.b, ``from a import b``
    gives a and a.b (b may be a module), relative imports are resolved against ``package``. With ``modules`` (the
    known module names), ``from a import b, c`` where every name is a submodule gives only a.b and a.c: the
    package ``a`` is only being initialised (``from . import _features`` inside a package's own module)."""
    return [(node.lineno, name) for node, _ in _import_nodes(ast.parse(source))
            for name in _names_of(node, package, modules)]


def _public_names_from(node, framework: str) -> bool:
    """Whether an import node is ``from <framework> import <public names>`` (the top-level package, no private name,
    no star)."""
    return (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == framework
            and all(alias.name != "*" and not alias.name.startswith("_") for alias in node.names))


def framework_imports(source: str, package: str, library: bool) -> list[tuple[int, str]]:
    """(line, why) of every framework import ``source`` may not make: at import time anywhere in ``tim_plugins/``;
    in the library (``library``), inside functions too, except `PUBLIC_INSIDE_FUNCTIONS`'s public names."""
    bad = []
    for node, deferred in _import_nodes(ast.parse(source)):
        for name in _names_of(node, package, None):
            framework = name.split(".")[0]
            if framework not in FRAMEWORKS:
                continue
            if not deferred:
                bad.append((node.lineno, f"imports {name} at import time"))
            elif library and not (framework == PUBLIC_INSIDE_FUNCTIONS and _public_names_from(node, framework)):
                only = (f" (inside a function the library takes only public names from {framework} itself)"
                        if framework == PUBLIC_INSIDE_FUNCTIONS else "")
                bad.append((node.lineno, f"imports {name}{only}"))
            break  # one finding per statement
    return bad


@cache
def registered_internals() -> dict[str, str]:
    """private attribute name -> the registry listing it, over every qualified name of every adapter registry
    (``GenerationMixin._get_logits_processor`` gives ``_get_logits_processor``; dunders are not internals)."""
    out: dict[str, str] = {}
    for registry, path in REGISTRIES.items():
        spec = importlib.util.spec_from_file_location(f"_layering_{registry}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for _, qualname in getattr(module, registry):
            for part in qualname.split("."):
                if part.startswith("_") and not part.startswith("__"):
                    out.setdefault(part, registry)
    return out


def internals_named(source: str, internals: dict[str, str], attributes: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(line, why) of every use in ``source`` of a registered internal or of one of ``attributes``: as an attribute
    (``x._name``) or as the string getattr/setattr/hasattr/``vars(x)`` take (``"_name"``)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in internals:
            bad.append((node.lineno, f"uses .{node.attr} ({internals[node.attr]})"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in internals:
            bad.append((node.lineno, f"names {node.value!r} ({internals[node.value]})"))
        elif isinstance(node, ast.Attribute) and node.attr in attributes:
            bad.append((node.lineno, f"reads .{node.attr} of a live engine"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in attributes:
            bad.append((node.lineno, f"names {node.value!r} of a live engine"))
    return sorted(bad)


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
    """The library may import neither an adapter nor an application (frameworks: `framework_imports`)."""
    if _under(imported, "tim_plugins.integrations"):
        return "an adapter"
    if _under(imported, "tim_plugins.apps"):
        return "an application"
    return None


def _adapter_violation(adapter: str, imported: str) -> str | None:
    for other in ADAPTERS:
        if other != adapter and other not in ADAPTER_IMPORTS[adapter] \
                and _under(imported, f"tim_plugins.integrations.{other}"):
            return f"the {other} adapter"
    if _under(imported, "tim_plugins.apps"):
        return "an application"
    return None


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_the_scanner_finds_nested_relative_and_dynamic_imports():
    """The reader below the rules: an import inside a function, relative imports that reach the adapters from
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
    assert sorted({line for line, name in found if _library_violation(name)}) == [4, 5]
    assert [line for line, _ in framework_imports(source, "tim_plugins.rollout", library=True)] == [3, 9]
    assert framework_imports(source, "tim_plugins.apps", library=False) == []  # both inside functions
    assert _adapter_violation("trl", "tim_plugins.integrations.verl.config") == "the verl adapter"
    assert _adapter_violation("trl", "tim_plugins.integrations.trl.hooks") is None
    assert _adapter_violation("trl", "tim_plugins.integrations.hf.recorder") is None  # an engine adapter
    assert _adapter_violation("hf", "tim_plugins.integrations.trl") == "the trl adapter"
    assert _adapter_violation("vllm", "tim_plugins.integrations.hf") == "the hf adapter"
    assert _adapter_violation("trl", "vllm") is None  # TRL's colocated engine: a framework, not our adapter


def test_the_scanner_tells_framework_imports_and_internals_apart():
    """transformers: public top-level names inside a function pass; at import time (a class body, a try block
    included), a submodule, a private name, ``import transformers`` or ray anywhere do not; a registered internal
    is found as an attribute and as the string getattr and vars take."""
    source = (
        "try:\n"
        "    import ray\n"
        "except ImportError:\n"
        "    ray = None\n"
        "class C:\n"
        "    from transformers import PreTrainedModel\n"
        "def ok():\n"
        "    from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "def bad(model):\n"
        "    from transformers.generation.utils import GenerationMixin\n"
        "    from transformers import _private\n"
        "    import transformers\n"
        "    model._get_logits_processor = None\n"
        "    return getattr(model.config, '_attn_implementation', None), vars(model).get('_get_logits_processor')\n"
        "def engine(llm, worker):\n"
        "    return llm.llm_engine.vllm_config, getattr(worker, 'model_runner', None)\n"
    )
    library = framework_imports(source, "tim_plugins", library=True)
    assert [line for line, _ in library] == [2, 6, 10, 11, 12]
    assert "at import time" in dict(library)[6] and "public names" in dict(library)[10]
    assert [line for line, _ in framework_imports(source, "tim_plugins.apps", library=False)] == [2, 6]
    internals = registered_internals()
    assert internals["_get_logits_processor"] == "TRANSFORMERS_SOURCES"
    assert internals["_attn_implementation"] == "TRANSFORMERS_SOURCES"
    assert internals["_SAMPLING_EPS"] == "VLLM_SOURCES"
    assert [line for line, _ in internals_named(source, internals)] == [13, 14, 14]
    assert [line for line, _ in internals_named(source, internals, VLLM_ENGINE_ATTRIBUTES)] == [13, 14, 14, 16, 16, 16]


def _core_modules(include_apps: bool):
    for name, package, path in _modules():
        if _under(name, "tim_plugins.integrations") or (not include_apps and _under(name, "tim_plugins.apps")):
            continue
        yield name, package, path


def _report(bad: dict[str, str], title: str) -> str:
    return title + "\n" + "\n".join(f"{where} {what}" for where, what in sorted(bad.items()))


def test_library_imports_no_adapter_and_no_application():
    bad: dict[str, str] = {}  # file:line -> what it imports (the first name of the statement)
    for name, package, path in _core_modules(include_apps=False):
        for line, imported in imports_of(path.read_text(), package):
            why = _library_violation(imported)
            if why:
                bad.setdefault(_where(path, line), f"imports {imported} ({why})")
    assert not bad, _report(bad, "the library must not import these (only tim_plugins/apps/ may):")


def test_core_imports_no_framework():
    """No module of tim_plugins/ imports a framework at import time; the library not even inside a function, but
    for public names of transformers itself (model builders and loaders)."""
    bad: dict[str, str] = {}
    for name, package, path in _core_modules(include_apps=True):
        library = not _under(name, "tim_plugins.apps")
        for line, why in framework_imports(path.read_text(), package, library):
            bad.setdefault(_where(path, line), why)
    assert not bad, _report(bad, "framework imports in the core (code that needs a framework belongs in "
                                 "integrations/, the applications import frameworks inside their commands):")


def test_core_names_no_framework_internal():
    """Patching or reading a framework's internals is the adapters' work (#38): no module of tim_plugins/ uses a
    private attribute an adapter registry lists, and the library reads no live vLLM engine."""
    internals = registered_internals()
    assert {"_get_logits_processor", "_attn_implementation", "_sample"} <= set(internals)
    bad: dict[str, str] = {}
    for name, package, path in _core_modules(include_apps=True):
        attributes = () if _under(name, "tim_plugins.apps") else VLLM_ENGINE_ATTRIBUTES
        for line, why in internals_named(path.read_text(), internals, attributes):
            bad.setdefault(_where(path, line), why)
    assert not bad, _report(bad, "framework internals used in the core (move the code into the adapter of that "
                                 "framework, integrations/<framework>/):")


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

