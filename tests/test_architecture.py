"""The package's structure: no import cycle (module-level and function-level imports
alike); the kernels (every module of ``jaxce._kernels``, found from the package, not
listed) import nothing above ``_kernels`` (every other module of the package, found the
same way) and use no other module's private names; no operation's kernel imports another
operation's (the operations found from the dispatcher's records); the wiring imports no
kernel; public modules say what they export."""

import ast
import pathlib

import pytest

import jaxce

PACKAGE = pathlib.Path(jaxce.__file__).parent


def _modules():
  """``{dotted name: path}`` of every module of the package (subpackages too)."""
  modules = {}
  for path in PACKAGE.rglob("*.py"):
    parts = ("jaxce",) + path.relative_to(PACKAGE).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


# Above the kernels: every module outside jaxce._kernels (the public names, the front
# door, the planner, the wiring, keep, objectives, reference, the integrations).
TOP = {m for m in _modules() if not m.startswith("jaxce._kernels")}


def kernels():
  return sorted(m for m in _modules() if m.startswith("jaxce._kernels"))


def _imports(module, path, modules):
  """The package modules ``module`` imports anywhere in its source (inside functions too),
  relative imports resolved."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
          package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
      submodules = {f"{base}.{a.name}" for a in node.names} & set(modules)
      # `from pkg import sub` needs the submodule; `from pkg import name` the package.
      found.update(submodules or ({base} & set(modules)))
  return found - {module}


def import_graph():
  modules = _modules()
  return {m: _imports(m, p, modules) for m, p in modules.items()}


def find_cycle(graph):
  """One import cycle of ``graph`` (``{module: imported modules}``) as a list that starts
  and ends with the same module, or ``None``."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def test_cycle_finder_finds_a_function_level_cycle(tmp_path):
  """The check itself: a function-level import that closes a loop is a cycle."""
  package = tmp_path / "pkg"
  package.mkdir()
  (package / "a.py").write_text("from pkg import b\n")
  (package / "b.py").write_text("def f():\n  from pkg import a  # lazy, still a cycle\n")
  modules = {"pkg.a": package / "a.py", "pkg.b": package / "b.py"}
  graph = {m: _imports(m, p, modules) for m, p in modules.items()}
  assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
  assert find_cycle({"pkg.a": {"pkg.b"}, "pkg.b": set()}) is None


def test_the_package_has_no_import_cycle():
  graph = import_graph()
  assert "jaxce._api" in graph and graph["jaxce"], graph  # the walk saw the package
  assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_kernels_are_found_from_the_package():
  assert {"jaxce._kernels.linear", "jaxce._kernels.mosaic.head", "jaxce._kernels.token_loss",
          "jaxce._kernels.linear_token_loss", "jaxce._kernels.softmax"} <= set(kernels())
  assert all(m in import_graph() for m in TOP)


@pytest.mark.parametrize("kernel", kernels())
def test_kernels_import_nothing_above_them(kernel):
  """No kernel imports the front door, the planner, the options, the wiring, or the
  public helpers (keep, objectives, reference)."""
  assert {"jaxce.keep", "jaxce.objectives", "jaxce.reference", "jaxce.plan"} <= TOP
  assert not import_graph()[kernel] & TOP, import_graph()[kernel] & TOP


def test_no_operation_imports_another():
  """Each public operation's kernel module (from the dispatcher's records) imports no
  other operation's: they share the floor modules (rows, head, softmax...) instead."""
  from jaxce import _dispatch
  operations = {op.kernel.__module__ for op in vars(_dispatch).values()
                if isinstance(op, _dispatch.Operation)}
  assert len(operations) == 4, operations
  for module in operations:
    assert not import_graph()[module] & (operations - {module}), module


def _private_uses(path, modules):
  """``module._name`` attribute uses and ``from module import _name`` imports of another
  jaxce module's private names in ``path``'s source."""
  tree = ast.parse(path.read_text())
  aliases = {}  # local name -> jaxce module
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxce"):
      for a in node.names:
        target = f"{node.module}.{a.name}"
        if target in modules:
          aliases[a.asname or a.name] = target
        elif a.name.startswith("_") and not a.name.startswith("__"):
          found.append(f"from {node.module} import {a.name}")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      found.append(f"{aliases[node.value.id]}.{node.attr}")
  return found


@pytest.mark.parametrize("kernel", kernels())
def test_kernels_use_no_private_helpers_of_other_modules(kernel):
  modules = _modules()
  assert not _private_uses(modules[kernel], modules)


def test_the_private_helper_check_can_fail(tmp_path):
  path = tmp_path / "k.py"
  path.write_text("from jaxce._kernels import linear\nx = linear._forward\n")
  assert _private_uses(path, _modules()) == ["jaxce._kernels.linear._forward"]


def test_the_wiring_imports_no_kernel_and_no_front_door():
  allowed = {"jaxce._kernels", "jaxce._kernels.plumbing"}  # JAX type plumbing, no maths
  assert not import_graph()["jaxce._sharded"] - allowed


@pytest.mark.parametrize("module", [jaxce, jaxce.plan, jaxce.reference])
def test_public_modules_export_what_they_define(module):
  names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
  for name in names:
    assert hasattr(module, name), (module.__name__, name)


@pytest.mark.parametrize("fn", [jaxce.reference.logprobs_and_entropy,
                                jaxce.reference.linear_logprobs_and_entropy,
                                jaxce.sharded_logprobs_and_entropy,
                                jaxce.sharded_linear_logprobs_and_entropy])
def test_unknown_keyword_is_a_type_error(fn):
  """A typo in an option is an error, not a silently unused keyword."""
  import numpy as np
  arrays = ((np.zeros((2, 4), np.float32),) if "linear" not in fn.__name__ else
            (np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32)))
  kw = {}
  if fn.__name__.startswith("sharded"):
    kw = dict(mesh=jax_mesh(), vocab_axis="v")
  with pytest.raises(TypeError, match="chunk_sizee"):
    fn(*arrays, np.zeros(2, np.int32), chunk_sizee=3, **kw)


def jax_mesh():
  import jax
  import numpy as np
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("v",))
