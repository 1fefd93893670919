"""The package's structure: no import cycle (module-level and function-level imports
alike), kernels that import neither the front door nor the shard_map wiring, and public
modules that say what they export."""

import ast
import pathlib

import pytest

import jaxce

PACKAGE = pathlib.Path(jaxce.__file__).parent
KERNELS = ("jaxce._logits", "jaxce._linear", "jaxce._pallas", "jaxce._math", "jaxce._chunking")


def _modules():
  return {"jaxce." + p.stem if p.stem != "__init__" else "jaxce": p
          for p in PACKAGE.glob("*.py")}


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


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_import_neither_the_front_door_nor_the_wiring(kernel):
  assert not import_graph()[kernel] & {"jaxce._api", "jaxce._sharded", "jaxce"}


def test_the_wiring_imports_no_kernel_and_no_front_door():
  assert not import_graph()["jaxce._sharded"] & {"jaxce._api", "jaxce._logits",
                                                  "jaxce._linear", "jaxce._pallas"}


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
