"""The code stays readable as it grows: no import cycle among hybridlab's modules, no import from a
higher layer (type hints count), no private attribute read from outside, no module over 400 lines,
no function over 60 (docs/architecture.md, "Limits"). Static: nothing is imported."""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridlab"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, tuple[Path, ast.Module]]:
    """Return every hybridlab module by dotted name, with its file and syntax tree (read once per
    test process: the checks only read it)."""
    return {module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if _type_checking_only(node):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo += list(ast.iter_child_nodes(node))
    return found


def import_graph(mods: dict[str, tuple[Path, ast.Module]]) -> dict[str, set[str]]:
    """Return, per hybridlab module, the hybridlab modules it imports (anywhere in its code). A
    name imported from a package that re-exports it from one of its submodules counts as an
    import of that submodule, so a package that re-exports its submodules' names forms no cycle
    with them; importing a submodule imports its packages too (Python runs their ``__init__``
    first, and whatever that imports)."""
    def package_of(name: str) -> str:
        return name if mods[name][0].name == "__init__.py" else name.rpartition(".")[0]

    reexports: dict[str, dict[str, str]] = {}  # package -> name -> its submodule that defines it
    for name, (path, tree) in mods.items():
        if path.name == "__init__.py":
            reexports[name] = {a.asname or a.name: _absolute(n, name, name) for n in tree.body
                               if isinstance(n, ast.ImportFrom) for a in n.names}

    graph: dict[str, set[str]] = {}
    for name, (path, tree) in mods.items():
        edges = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in mods}
                continue
            base = _absolute(node, name, package_of(name))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in mods:
                    edges.add(target)
                elif base in mods:
                    edges.add(reexports.get(base, {}).get(alias.name, base) if base != name else base)
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first (those above this module ran already)
        own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
        edges |= {parent for e in edges for parent in _parents(e) if parent in mods and parent not in own}
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def _parents(module: str) -> list[str]:
    return [module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)]


def _absolute(node: ast.ImportFrom, module: str, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(import_graph(modules()))
    assert found == [], "hybridlab modules import each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_check_sees_imports_inside_functions_and_through_packages(tmp_path):
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    from p.b import B\ndef f():\n    from p import a_name\n")
    assert [ast.unparse(n) for n in _imports(tree)][::-1] == ["import os", "from p import a_name"]
    mods = {"p": (Path("p/__init__.py"), ast.parse("from p.a import a_name\n")),
            "p.a": (Path("p/a.py"), ast.parse("def a_name():\n    from p.b import g\n")),
            "p.b": (Path("p/b.py"), ast.parse("def g():\n    from p import a_name\n"))}
    graph = import_graph(mods)
    assert graph == {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}}
    assert cycles(graph) == [["p.a", "p.b"]]
    # a registry: the package imports a submodule to register it, which imports the package's API,
    # which imports the package to have the built-ins registered
    mods = {"q": (Path("q/__init__.py"), ast.parse("from q.api import get\nfrom q import builtin\n")),
            "q.api": (Path("q/api.py"), ast.parse("def get():\n    import q\n")),
            "q.builtin": (Path("q/builtin.py"), ast.parse("from q.api import get\n"))}
    assert cycles(import_graph(mods)) == [["q", "q.api", "q.builtin"]]
    # importing r.schema runs r/__init__.py, which imports r.checks, which imports s.w, which
    # imports r.schema: a cycle through the package, though no module names r itself
    mods = {"r": (Path("r/__init__.py"), ast.parse("from r.checks import check\n")),
            "r.schema": (Path("r/schema.py"), ast.parse("X = 1\n")),
            "r.checks": (Path("r/checks.py"), ast.parse("from s.w import W\n")),
            "s": (Path("s/__init__.py"), ast.parse("")),
            "s.w": (Path("s/w.py"), ast.parse("from r.schema import X\n"))}
    assert cycles(import_graph(mods)) == [["r", "r.checks", "s.w"]]


def test_no_module_over_400_lines():
    long = {name: n for name, (path, _) in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def test_no_function_over_60_lines():
    long = {}
    for name, (_, tree) in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = lines
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


# The layers, lowest first: a module imports only from its own layer and the ones below it,
# counting imports inside functions and ``if TYPE_CHECKING:`` type hints (docs/architecture.md,
# "Layers"). A module belongs to the layer of the longest prefix that names it.
LAYERS = [
    ("base", ["errors", "atomic", "environment", "faults", "protocol", "user_code", "config"]),
    ("engines", ["batching", "models", "algos", "tasks", "sandbox", "scorers", "reshard", "workers", "agents",
                 "controller", "telemetry", "sft", "evaluate"]),
    ("step", ["dataflow", "backend_checks", "run_config", "explain", "verl"]),
    ("advisor", ["advisor"]),
    ("notebook", ["notebook"]),
    ("run", ["dataflow.session", "dataflow.step", "dataflow.live", "dataflow.train_loop", "dataflow.remap",
             "dataflow.recovery", "dataflow.checkpoints"]),
    ("service", ["tinker"]),
    ("commands", ["cli", "train_command", "score_command", "serve_command", "bench", "advisor.calibrate", "advisor.commands"]),
]


def layer_of(module: str) -> int:
    """Return the index in LAYERS of a hybridlab module's layer; raises KeyError for one in none."""
    name = module.removeprefix("hybridlab.")
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if name == p or name.startswith(p + ".")]
    if not found:
        raise KeyError(f"{module} is in no layer of tests/test_layout.py's LAYERS")
    return max(found)[1]


def every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, type hints' included."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Return 'a (layer) -> b (layer)' for each import of a higher layer's module."""
    out = []
    for module, targets in sorted(graph.items()):
        if module == "hybridlab":
            continue
        for target in sorted(targets - {"hybridlab"}):
            if layer_of(target) > layer_of(module):
                out.append(f"{module} ({LAYERS[layer_of(module)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    return out


def test_no_import_from_a_higher_layer(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_imports", every_import)
    found = layer_violations(import_graph(modules()))
    assert found == [], "imports from a higher layer (type hints count):\n" + "\n".join(found)


def test_the_layer_check_counts_type_hints_and_deferred_imports(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_imports", every_import)
    mods = {"hybridlab.dataflow.context": (Path("c.py"), ast.parse(
                "if TYPE_CHECKING:\n    from hybridlab.dataflow.session import RLSession\n")),
            "hybridlab.errors": (Path("e.py"), ast.parse("def f():\n    from hybridlab.cli import main\n")),
            "hybridlab.dataflow.session": (Path("s.py"), ast.parse("from hybridlab.errors import UserError\n")),
            "hybridlab.cli": (Path("cli.py"), ast.parse(""))}
    assert layer_violations(import_graph(mods)) == [
        "hybridlab.dataflow.context (step) -> hybridlab.dataflow.session (run)",
        "hybridlab.errors (base) -> hybridlab.cli (commands)"]


# Private attributes read across modules on purpose: a third-party object's, where the library
# offers no public way (each with its reason); anything else of hybridlab's is public or stays inside.
THIRD_PARTY_PRIVATE = {
    "hybridlab/agents/endpoint.py": {"site._server"},           # aiohttp: the bound port of a port-0 site
    "hybridlab/telemetry/dashboard.py": {"self.tabs._names"},   # Panel: a Tabs' titles
    # torch: ProcessGroupGloo's options, the one way to give a gloo group a device of one's choosing
    "hybridlab/controller/gloo_device.py": {"_GLOO._Options", "options._devices", "options._timeout",
                                            "options._threads"},
    "hybridlab/workers/rollout/vllm_engine.py": {"manager._adapter_manager", "parallel_state._TP",
                                                 "parallel_state._PP", "torch._dynamo", "super()._distributed_args"},
    "hybridlab/workers/train/cpu_compat.py": {"mp_random._get_cuda_rng_state", "mp_random._set_cuda_rng_state"},
    "hybridlab/workers/train/engine.py": {"import torch._utils._flatten_dense_tensors",  # torch's bucket flattening
                                          "import torch._utils._unflatten_dense_tensors"},
    "hybridlab/workers/train/fsdp_engine.py": {"model._no_split_modules"},   # transformers: the blocks to wrap
    "hybridlab/workers/train/fsdp_model.py": {"lm._no_split_modules"},
    # the worker's dispatch marks on its methods, read by the worker host (one concept, two classes)
    "hybridlab/controller/worker.py": {"fn._hl_dispatch", "fn._hl_blocking"},
    "hybridlab/controller/group.py": {"self.group._dispatch"},
}


def private_reach_ins(path: Path, tree: ast.Module) -> set[str]:
    """Return a module's reads of another object's private attribute (``x._name``, not ``self._name``
    or ``cls._name``) and its imports of another module's private name."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.add(ast.unparse(node))
        if isinstance(node, ast.ImportFrom):
            out |= {f"import {node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
    return out


def test_no_private_reach_ins():
    found = {}
    for name, (path, tree) in modules().items():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        extra = private_reach_ins(path, tree) - THIRD_PARTY_PRIVATE.get(rel, set())
        if name == "hybridlab.dataflow.session":  # its own classmethod sets up the instance it returns
            extra -= {"rl._resume_from"}
        if extra:
            found[rel] = sorted(extra)
    assert found == {}, f"private attributes or names read from outside their module: {found}"


def test_the_reach_in_check_sees_attributes_and_imports():
    tree = ast.parse("from a import _b, c\nself._ok = rl._edits\ncls._fine = 1\n")
    assert private_reach_ins(Path("x.py"), tree) == {"import a._b", "rl._edits"}


# hybridlab's own modules imported inside a function, outside the command line's lazy loading
# (cli.py, advisor/commands.py, score_command.py, serve_command.py, train_command.py, bench/): each defers a heavy
# third-party dependency
# (docs/architecture.md, "Limits").
DEFERRED = {
    ("hybridlab/advisor/calibrate.py", "hybridlab.workers.rollout"),      # vLLM, for the engine measurement only
    ("hybridlab/agents/rollout.py", "hybridlab.agents.endpoint"),         # aiohttp, for agents given an endpoint
    ("hybridlab/agents/rollout.py", "hybridlab.workers.rollout.vllm_engine"),  # vLLM, in the rollout worker only
    ("hybridlab/dataflow/session.py", "hybridlab.notebook"),              # ipywidgets, for the widget verbs
    ("hybridlab/dataflow/session.py", "hybridlab.notebook.batch_table"),  # ipywidgets, for rl.inspect
    ("hybridlab/workers/train/model.py", "hybridlab.workers.train"),      # Megatron, imported in its order
}


def deferred_imports() -> list[tuple[str, str]]:
    """Return (file, module) for each import of a hybridlab module inside a function, outside
    the command line's modules."""
    out = []
    for name, (path, tree) in modules().items():
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel in ("hybridlab/cli.py", "hybridlab/advisor/commands.py", "hybridlab/score_command.py", "hybridlab/serve_command.py",
                   "hybridlab/train_command.py") \
                or rel.startswith("hybridlab/bench/"):
            continue  # the command line's lazy loading: `hybridlab --help` stays fast
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out += [(rel, n.module) for n in ast.walk(fn)
                        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("hybridlab")]
                out += [(rel, a.name) for n in ast.walk(fn) if isinstance(n, ast.Import)
                        for a in n.names if a.name.startswith("hybridlab")]
    return out


def test_deferred_imports_only_for_heavy_dependencies():
    found = deferred_imports()
    assert set(found) <= DEFERRED, f"imports inside functions that are not listed in DEFERRED: {set(found) - DEFERRED}"
    assert len(found) <= 8, f"{len(found)} deferred imports of hybridlab modules (at most 8): {found}"
