"""The package's import structure: every module imports on its own, and the imports
between keras_spatial's modules form no cycle (none hidden inside a function either)."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "keras_spatial")


def _modules() -> dict[str, str]:
    """{module name: file} of every module of keras_spatial."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


def _is_type_checking_block(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(node, module: str, is_package: bool, known) -> set[str]:
    """keras_spatial modules that an Import/ImportFrom node loads (a package's
    __init__ included when a name is taken from it)."""
    found = set()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c loads a, a.b and a.b.c
            prefix = ".".join(parts[:i])
            if prefix in known:
                found.add(prefix)
    return found


def _import_graph():
    """(module -> modules it imports at load time, [(module, line) of imports of
    keras_spatial inside functions])."""
    modules = _modules()
    graph, nested = {}, []
    for module, path in modules.items():
        tree = ast.parse(open(path).read(), path)
        is_package = path.endswith("__init__.py")
        edges = set()

        def visit(body, in_function):
            for node in body:
                if _is_type_checking_block(node):
                    continue
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    targets = _imported(node, module, is_package, modules) - {module}
                    if in_function and targets:
                        nested.append((module, node.lineno))
                    elif not in_function:
                        edges.update(targets)
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit(inner, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree.body, False)
        # A submodule's import first loads its parent packages.
        parts = module.split(".")
        edges.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        graph[module] = edges - {module}
    return graph, nested


def _cycle(graph):
    """One cycle of `graph` as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _parent_edges_removed(graph):
    """The graph without 'a submodule needs its package' edges, whose reverse (a package's
    __init__ importing its own submodules) is how every package exposes its names."""
    out = {}
    for module, edges in graph.items():
        out[module] = {e for e in edges if not module.startswith(e + ".")}
    return out


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_modules():
    graph, _ = _import_graph()
    assert "keras_spatial.strategy" in graph and graph["keras_spatial.strategy"], graph
    assert _cycle(_parent_edges_removed(graph)) is None, _cycle(_parent_edges_removed(graph))


def test_no_keras_spatial_import_inside_a_function():
    _, nested = _import_graph()
    assert not nested, f"imports of keras_spatial inside functions (hidden cycles?): {nested}"


def test_every_module_imports_on_its_own():
    """Each module imported first, with no other keras_spatial module loaded before it
    (one interpreter; TensorFlow and Keras stay loaded, keras_spatial is unloaded between
    modules)."""
    script = f"""
import importlib, sys, traceback
import keras, tensorflow
failures = []
for name in {sorted(_modules())!r}:
    for loaded in [m for m in sys.modules if m == "keras_spatial" or m.startswith("keras_spatial.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failures.append((name, traceback.format_exc(limit=3)))
for name, text in failures:
    print("FAILED", name, text)
print("IMPORTED", len({sorted(_modules())!r}) - len(failures))
"""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FAILED" not in result.stdout, result.stdout
    assert f"IMPORTED {len(_modules())}" in result.stdout, result.stdout
