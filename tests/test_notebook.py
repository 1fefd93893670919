"""The notebook (notebooks/memory_vs_chunk_size.ipynb) executes on CPU and draws its plots.

It runs in a Jupyter kernel on this interpreter (nbclient), with the small preset
(``JAXCE_NOTEBOOK_SIZE=small``), through the same runner the GPU run uses
(notebooks/run_notebook.py). The runner's no-Jupyter fallback (exec in this process) is
checked on a tiny notebook.
"""

import base64
import importlib.util
import json
import pathlib

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_runner():
  spec = importlib.util.spec_from_file_location("run_notebook", NOTEBOOKS / "run_notebook.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


runner = _load_runner()


def _outputs(nb, kind):
  return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]
          if o["output_type"] == kind]


def _pngs(nb):
  pngs = [o["data"]["image/png"] for o in _outputs(nb, "display_data") if "image/png" in o["data"]]
  return [base64.b64decode(p if isinstance(p, str) else "".join(p)) for p in pngs]


def test_notebook_executes_and_plots(tmp_path, monkeypatch):
  pytest.importorskip("nbclient", reason="the notebook runs in a Jupyter kernel: pip install "
                      "-e '.[test]' (GPU images may lack it)")
  monkeypatch.setenv("JAXCE_NOTEBOOK_SIZE", "small")
  monkeypatch.delenv("JAXCE_NOTEBOOK_DTYPE", raising=False)
  monkeypatch.delenv("PYTHONPATH", raising=False)  # the notebook must find jaxce itself
  out = tmp_path / "executed.ipynb"
  status = runner.main(["--out", str(out), "--mode", "nbclient", "--timeout", "300"])
  nb = json.loads(out.read_text())
  errors = [f"{o['ename']}: {o['evalue']}" for o in _outputs(nb, "error")]
  assert status == 0 and not errors, errors
  code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
  assert all(c["execution_count"] is not None for c in code_cells)
  # logits sweep, fused sweep, time, sharded, summary (the measured-peak plot needs a GPU)
  pngs = _pngs(nb)
  assert len(pngs) >= 5 and all(p.startswith(PNG_MAGIC) for p in pngs), len(pngs)
  first = "".join(nb["cells"][0]["source"])
  assert f"{runner.PROVENANCE} produced on " in first and "size preset 'small'" in first, first
  if "(cpu, " in first:  # no memory_stats(): the peak cells only check the child process
    printed = "".join("".join(o["text"]) for o in _outputs(nb, "stream") if o["name"] == "stdout")
    assert "child process check: ok" in printed
    assert "the child process compiled the same plan: True" in printed


def test_runner_exec_fallback(tmp_path):
  nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
      {"cell_type": "markdown", "metadata": {}, "source": f"# t\n\n{runner.PROVENANCE} unknown"},
      {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
       "source": f"print('{runner.PRODUCED_ON} here, JAX x')\nimport os\nos.getcwd()"},
      {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
       "source": "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()"},
      {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
       "source": "raise ValueError('boom')"},
      {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
       "source": "print('never')"},
  ]}
  source, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
  source.write_text(json.dumps(nb))
  status = runner.main(["--in", str(source), "--out", str(out), "--mode", "exec"])
  result = json.loads(out.read_text())
  first, second, third, fourth = result["cells"][1:]
  assert status == 1  # a cell raised
  assert first["outputs"][0]["text"].startswith(runner.PRODUCED_ON)
  assert first["outputs"][1]["data"]["text/plain"] == repr(str(tmp_path.resolve()))  # ran in its folder
  assert len(_pngs({"cells": [second]})) == 1
  assert third["outputs"][-1]["ename"] == "ValueError"
  assert fourth["execution_count"] is None and not fourth["outputs"]
  assert result["cells"][0]["source"].endswith(f"{runner.PROVENANCE} produced on here, JAX x.")


if __name__ == "__main__":
  pytest.main([__file__, "-q"])
