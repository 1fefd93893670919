"""Execute ``memory_vs_chunk_size.ipynb`` and write the executed copy.

    python notebooks/run_notebook.py --out OUT.ipynb [--in IN.ipynb] [--size small|gpu]
                                     [--mode auto|nbclient|exec] [--timeout SECONDS]

``nbclient`` mode runs a Jupyter kernel on *this* interpreter (a throwaway kernel spec
pointing at ``sys.executable``, so no installed ``python3`` spec can pick another
Python), with the notebook's folder as its working directory. ``exec`` mode needs
nothing beyond the notebook's own imports: it runs the code cells in this process with
``exec()`` and stores their stdout/stderr, the last expression's repr, errors and every
open matplotlib figure (as PNG) into the notebook JSON itself. ``auto`` (the default)
uses nbclient when nbclient, jupyter_client and ipykernel import, else exec.

Afterwards the line ``**Committed outputs:** ...`` of the first markdown cell is
rewritten from the ``Outputs produced on: ...`` line that the first code cell printed.
Exits non-zero (after writing OUT) if a cell raised.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_NOTEBOOK = NOTEBOOK_DIR / "memory_vs_chunk_size.ipynb"
# The first markdown cell's provenance line, rewritten after each run.
PROVENANCE = "**Committed outputs:**"
# The first code cell prints a line that starts with this.
PRODUCED_ON = "Outputs produced on:"
KERNEL_NAME = "jaxce-notebook-python"


def _join(text) -> str:
  """Notebook JSON stores text as a string or a list of lines."""
  return "".join(text) if isinstance(text, list) else text


def _source(cell) -> str:
  return _join(cell.get("source", ""))


def _log(message):
  print(message, file=sys.__stderr__, flush=True)


def _clear(nb):
  for cell in nb["cells"]:
    if cell["cell_type"] == "code":
      cell["outputs"], cell["execution_count"] = [], None


# --- nbclient: a real kernel on this interpreter ------------------------------------

def _nbclient_available() -> bool:
  try:
    import ipykernel  # noqa: F401
    import jupyter_client  # noqa: F401
    import nbclient  # noqa: F401
    import nbformat  # noqa: F401
  except ImportError:
    return False
  return True


def execute_nbclient(nb_json, workdir, timeout):
  """Execute with nbclient; returns (notebook dict, error message or None)."""
  import nbclient
  import nbformat
  from ipykernel.kernelspec import write_kernel_spec
  from jupyter_client.kernelspec import KernelSpecManager
  from jupyter_client.manager import AsyncKernelManager

  nb = nbformat.reads(json.dumps(nb_json), as_version=4)
  with tempfile.TemporaryDirectory() as specs:
    write_kernel_spec(path=os.path.join(specs, KERNEL_NAME))  # argv[0] = sys.executable
    km = AsyncKernelManager(kernel_name=KERNEL_NAME,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[specs]))
    client = nbclient.NotebookClient(
        nb, km=km, kernel_name=KERNEL_NAME, timeout=timeout,
        resources={"metadata": {"path": str(workdir)}})
    started = time.perf_counter()
    client.on_cell_executed = lambda cell, cell_index, execute_reply: _log(
        f"  cell {cell_index:2d} done at {time.perf_counter() - started:6.1f} s")
    error = None
    try:
      client.execute(cleanup_kc=True)  # shut the kernel down, though we made its manager
    except nbclient.exceptions.CellExecutionError as e:
      error = str(e).strip().splitlines()[-1]
  return json.loads(nbformat.writes(nb)), error


# --- exec: in this process, no Jupyter needed -----------------------------------------

def _figure_outputs():
  import matplotlib.pyplot as plt
  outputs = []
  for number in plt.get_fignums():
    fig = plt.figure(number)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    outputs.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
                             "text/plain": [repr(fig)]}})
  plt.close("all")
  return outputs


def _run_cell(src, namespace):
  """exec() one cell's source; returns (repr of a trailing expression or None, error)."""
  tree = ast.parse(src)
  last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
  exec(compile(tree, "<cell>", "exec"), namespace)  # noqa: S102 -- that is the point
  if last is None:
    return None
  value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)  # noqa: S307
  return None if value is None else repr(value)


def execute_inprocess(nb_json, workdir):
  """Execute the code cells in this process; returns (notebook dict, error or None)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  saved_cwd, saved_show, saved_path = os.getcwd(), plt.show, list(sys.path)
  plt.show = lambda *args, **kwargs: None  # figures are collected after each cell
  os.chdir(workdir)
  sys.path.insert(0, str(workdir))
  namespace = {"__name__": "__main__"}
  started, count, error = time.perf_counter(), 0, None
  try:
    for index, cell in enumerate(nb_json["cells"]):
      if cell["cell_type"] != "code":
        continue
      count += 1
      stdout, stderr = io.StringIO(), io.StringIO()
      result = failure = None
      with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
          result = _run_cell(_source(cell), namespace)
        except Exception as e:  # noqa: BLE001 -- recorded in the notebook, then we stop
          failure = {"output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                     "traceback": traceback.format_exc().splitlines()}
      outputs = [{"output_type": "stream", "name": name, "text": text.getvalue()}
                 for name, text in (("stdout", stdout), ("stderr", stderr)) if text.getvalue()]
      if result is not None:
        outputs.append({"output_type": "execute_result", "execution_count": count,
                        "metadata": {}, "data": {"text/plain": result}})
      outputs += _figure_outputs()
      if failure:
        outputs.append(failure)
      cell["outputs"], cell["execution_count"] = outputs, count
      _log(f"  cell {index:2d} done at {time.perf_counter() - started:6.1f} s")
      if failure:
        error = f"cell {index}: {failure['ename']}: {failure['evalue']}"
        break
  finally:
    os.chdir(saved_cwd)
    plt.show = saved_show
    sys.path[:] = saved_path
  return nb_json, error


# --- provenance ------------------------------------------------------------------------

def fill_provenance(nb_json):
  """Copy the first code cell's ``Outputs produced on: ...`` line into the first
  markdown cell's ``**Committed outputs:**`` line. Returns the text used, or None."""
  code = next((c for c in nb_json["cells"] if c["cell_type"] == "code"), None)
  markdown = next((c for c in nb_json["cells"] if c["cell_type"] == "markdown"), None)
  if code is None or markdown is None:
    return None
  printed = "".join(_join(o.get("text", "")) for o in code.get("outputs", [])
                    if o.get("output_type") == "stream")
  line = next((l for l in printed.splitlines() if l.startswith(PRODUCED_ON)), None)
  if line is None:
    return None
  produced = line[len(PRODUCED_ON):].strip()
  lines = _source(markdown).split("\n")
  lines = [f"{PROVENANCE} produced on {produced}." if l.startswith(PROVENANCE) else l
           for l in lines]
  markdown["source"] = "\n".join(lines)
  return produced


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--in", dest="inp", default=str(DEFAULT_NOTEBOOK))
  parser.add_argument("--out", required=True)
  parser.add_argument("--size", choices=("small", "gpu"),
                      help="sets JAXCE_NOTEBOOK_SIZE (default: the notebook's own choice)")
  parser.add_argument("--mode", choices=("auto", "nbclient", "exec"), default="auto")
  parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell (nbclient)")
  args = parser.parse_args(argv)

  if args.size:
    os.environ["JAXCE_NOTEBOOK_SIZE"] = args.size
  source = pathlib.Path(args.inp).resolve()
  nb_json = json.loads(source.read_text())
  _clear(nb_json)
  mode = args.mode
  if mode == "auto":
    mode = "nbclient" if _nbclient_available() else "exec"
  _log(f"executing {source} ({mode})")
  if mode == "nbclient":
    nb_json, error = execute_nbclient(nb_json, source.parent, args.timeout)
  else:
    nb_json, error = execute_inprocess(nb_json, source.parent)
  nb_json.setdefault("metadata", {})["kernelspec"] = {
      "name": "python3", "display_name": "Python 3", "language": "python"}
  produced = fill_provenance(nb_json)
  out = pathlib.Path(args.out)
  out.write_text(json.dumps(nb_json, indent=1, ensure_ascii=False) + "\n")
  _log(f"wrote {out}; outputs produced on: {produced}")
  if error:
    _log(f"FAILED: {error}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
