"""Sphinx configuration of jaxce's documentation (``docs/``).

Sphinx + autodoc + napoleon + MyST, as jax, flax, optax and chex build theirs. Build:

    pip install -r docs/requirements.txt -e .
    sphinx-build -W --keep-going -b html docs docs/_build/html

The build imports jaxce on CPU only (``JAX_PLATFORMS=cpu``: nothing needs a GPU) and mocks
Tunix for ``jaxce.integrations.tunix`` (its docstrings need no Tunix installed). The
notebook is rendered from its committed outputs (myst-nb, execution off).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's jaxce, installed or not

import jaxce  # noqa: E402

project = "jaxce"
author = "the jaxce authors"
copyright = "2026, the jaxce authors"
release = jaxce.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
    "myst_nb",  # MyST markdown (myst_parser) and notebooks from their saved outputs
    "sphinx_copybutton",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "requirements.txt", "README.md", "Thumbs.db", ".DS_Store"]

# -- MyST / myst-nb -------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # the notebook's committed outputs (a run on one H200)
nb_merge_streams = True

# -- autodoc / napoleon ---------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# The public functions take jax.typing.ArrayLike: show the name, not its expansion.
autodoc_type_aliases = {"ArrayLike": "jax.typing.ArrayLike"}
autodoc_default_options = {"members": True, "undoc-members": False}
# Tunix (google-tunix, extra `jaxce[tunix]`) is heavy and not needed to read the
# docstrings; flax only where the docs environment lacks it.
autodoc_mock_imports = ["tunix"] + [m for m in ("flax",) if importlib.util.find_spec(m) is None]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # a NamedTuple's "Attributes:" as fields, not a second description

# Broken cross-references are warnings (and -W makes them errors).
nitpicky = True
nitpick_ignore_regex = [
    ("py:class", r"(int|float|str|bool|object|tuple|list|dict|None|NamedTuple)"),
    ("py:class", r"jax\..*|Array|ArrayLike|numpy\..*|Callable|Backend"),
    # (a private record in the plans' annotations, described where it is used)
    ("py:class", r"jaxce\._kernels\.chunking\.RowChunks"),
]

# -- HTML -----------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"jaxce {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    # A placeholder until the project has a public home.
    "repository_url": "https://github.com/jaxce/jaxce",
    "use_repository_button": True,
    "show_toc_level": 2,
}


def _copy_notebook(app):
  """The notebook lives in ``notebooks/`` (CI executes it there); the docs render a copy
  from its committed outputs (``docs/notebooks/`` is a build artefact, git-ignored)."""
  target = DOCS / "notebooks"
  target.mkdir(exist_ok=True)
  source = ROOT / "notebooks" / "memory_vs_chunk_size.ipynb"
  if not (target / source.name).exists() or (
      (target / source.name).read_bytes() != source.read_bytes()):
    shutil.copyfile(source, target / source.name)


_FIELD_NAMES = re.compile(r"^(\s+)[\w*, ]+,$")


def _join_argument_names(app, what, name, obj, options, lines):
  """Before napoleon: an ``Args:`` entry whose list of names runs over two lines
  (``a, b, c,`` then ``d: as in ...``) becomes one line, as napoleon reads one."""
  i = 0
  while i < len(lines) - 1:
    head, nxt = _FIELD_NAMES.match(lines[i]), lines[i + 1]
    if head and ":" in nxt and len(nxt) - len(nxt.lstrip()) > len(head.group(1)):
      lines[i:i + 2] = [lines[i] + " " + nxt.strip()]
    else:
      i += 1


def _literal_blocks(app, what, name, obj, options, lines):
  """After napoleon: the docstrings show code as an indented block after a blank line
  (as a README does); reST would read a block quote, so make it a literal block."""
  out = []
  for line in lines:
    if line[:1].isspace() and line.strip() and out and not out[-1].strip():
      j = len(out) - 1
      while j >= 0 and not out[j].strip():
        j -= 1
      intro = out[j] if j >= 0 else ""
      if intro and not intro.startswith((" ", ":", "..")) and not intro.endswith("::"):
        if intro.endswith(":"):
          out[j] += ":"
        else:
          out += ["::", ""]
    out.append(line)
  lines[:] = out


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
  """A NamedTuple's fields are described by its docstring's ``Attributes:``."""
  if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return None


def setup(app):
  app.connect("builder-inited", _copy_notebook)
  app.connect("autodoc-process-docstring", _join_argument_names, priority=400)
  app.connect("autodoc-process-docstring", _literal_blocks, priority=600)
  app.connect("autodoc-skip-member", _skip_namedtuple_fields)
