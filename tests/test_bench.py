"""The benchmark's smoke suite end to end on CPU: ``python -m bench --suite smoke``.

One subprocess runs the whole suite (about 30 s on 2 cores) into a temporary results
directory; the tests then check the JSON schema of issue 4, the table and the plot, that
the printed table is the written one, that merging a second run (``--merge``) replaces rows
instead of duplicating them, and that a run with the default destination leaves the
checkout clean. The GPU-only modules are imported, and run where they can on CPU.
"""

import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from bench import configs, report
from helpers import devices
import jaxce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOP_LEVEL = {"device": str, "n_devices": int, "jax": str, "hbm_GBps": float,
             "bf16_tflops": float, "commit": str, "rows": list}
ROW = {"impl": str, "input": str, "mode": str, "T": int, "V": int, "D": (int, type(None)),
       "dtype": str, "chunk_size": (int, type(None)), "n_devices": int, "status": str,
       "peak_extra_bytes": int, "logits_bytes": int, "ms": float, "floor_ms": float}


def _run_smoke(out_dir, *extra):
  out = ["--out", str(out_dir)] if out_dir is not None else []
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "bench", "--suite", "smoke", "--repeats", "2",
                         *out, *extra], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  proc = _run_smoke(out)
  with open(out / "cpu.json") as f:
    return out, json.load(f), proc.stdout


def _check_type(value, expected, what):
  # bool is an int subclass in Python; a bool is never a valid count or size here.
  assert not isinstance(value, bool), f"{what}: got bool {value!r}"
  assert isinstance(value, expected), f"{what}: {value!r} is not {expected}"


def test_top_level_schema(smoke):
  _, results, _ = smoke
  for key, kind in TOP_LEVEL.items():
    assert key in results, f"missing top-level key {key}"
    _check_type(results[key], kind, key)
  assert results["hbm_GBps"] > 0 and results["bf16_tflops"] > 0
  assert results["n_devices"] >= 2, "the smoke suite's sharded rows need 2 devices"
  # the full hash from git, or the commit a copied tree was sent from (JAXCE_COMMIT wins)
  sent_from = os.environ.get("JAXCE_COMMIT", "")
  assert results["commit"] == sent_from if sent_from else len(results["commit"]) in (0, 40)


def test_row_schema(smoke):
  _, results, _ = smoke
  rows = results["rows"]
  assert len(rows) == len(configs.expand(configs.SUITES["smoke"]))
  for i, row in enumerate(rows):
    assert row["status"] in report.STATUSES, row
    assert row["input"] in ("logits", "linear") and row["mode"] in configs.MODES, row
    assert row["impl"] in configs.IMPLS and row["variant"] in configs.VARIANTS, row
    for key, kind in ROW.items():
      assert key in row, f"row {i} misses {key}"
      if row["status"] != "ok" and key in ("peak_extra_bytes", "ms"):
        assert row[key] is None, f"row {i}: failed rows carry no {key}"
        continue
      _check_type(row[key], kind, f"row {i} {key}")
    assert isinstance(row["entropy"], bool) and isinstance(row["commit"], str), row
    if row["status"] == "ok":
      assert row["memory_source"] in ("xla_plan", "device_peak", "torch_cuda_peak",
                                      "host_rss"), row
      _check_type(row["x_floor"], float, f"row {i} x_floor")
      _check_type(row["x_logits"], float, f"row {i} x_logits")
    assert (row["D"] is None) == (row["input"] == "logits"), row
    assert row["floor_ms"] > 0 and math.isfinite(row["floor_ms"]), row
    assert row["logits_bytes"] == row["T"] * (row["V"] // row["n_devices"]) * 2, row


def test_rows_say_what_their_program_ran(smoke):
  """Each JAX row records its compiled program's custom calls and collectives (XLA's
  optimized HLO, an instruction once): a sharded row shows its collectives, a row on one
  device none; on CPU no kernel is a custom call."""
  _, results, _ = smoke
  for row in results["rows"]:
    if row["status"] != "ok" or row["impl"] in configs.TORCH_IMPLS:
      continue
    program = row["program"]
    assert set(program) == {"custom_calls", "collectives"}, row
    for counts in program.values():
      assert all(isinstance(k, str) and isinstance(v, int) and v > 0
                 for k, v in counts.items()), row
    assert bool(program["collectives"]) == (row["n_devices"] > 1), (report.name(row), program)


def test_jaxce_and_plain_ran_in_both_modes(smoke):
  _, results, _ = smoke
  failed = [r for r in results["rows"] if r["status"] != "ok"]
  assert not failed, [(report.name(r), r["error"]) for r in failed]
  for impl in ("jaxce", "jax_plain"):
    for mode in configs.MODES:
      for inp in ("logits", "linear"):
        rows = [r for r in results["rows"] if (r["impl"], r["variant"], r["mode"], r["input"])
                == (impl, "default", mode, inp) and r["n_devices"] == 1]
        assert rows, f"no {impl} {inp} {mode} row"
        for r in rows:
          assert r["ms"] > 0 and r["floor_ms"] > 0 and r["peak_extra_bytes"] > 0, r
          assert r["memory_source"] == "xla_plan", r
  sharded = {(r["impl"], r["input"]) for r in results["rows"] if r["n_devices"] == 2}
  assert {("jaxce", "logits"), ("jax_plain", "logits"), ("jaxce", "linear")} <= sharded


def test_kept_set_rows(smoke):
  """The kept-set variants ran on both inputs, saying what they keep."""
  _, results, _ = smoke
  for variant, words in (("keep", "packed words"), ("kept_ids", "from_csr")):
    for inp in ("logits", "linear"):
      rows = [r for r in results["rows"] if (r["impl"], r["variant"], r["input"]) ==
              ("jaxce", variant, inp)]
      assert len(rows) == 1 and rows[0]["status"] == "ok", rows
      assert words in rows[0]["note"], rows[0]


def test_memory_ordering(smoke):
  """The plan of jaxce's logits backward holds fewer bytes than plain JAX's."""
  _, results, _ = smoke
  extra = {(r["impl"], r["T"]): r["peak_extra_bytes"] for r in results["rows"]
           if (r["input"], r["mode"], r["variant"], r["n_devices"]) ==
           ("logits", "fwd_bwd", "default", 1)}
  for T in (64, 200):
    assert extra[("jaxce", T)] < extra[("jax_plain", T)], extra


def test_table_and_plot_written(smoke):
  out, results, stdout = smoke
  md = (out / "cpu.md").read_text()
  assert md.startswith("# Benchmark results")
  assert md.count("\n| jaxce") >= 6 and "| jax_plain" in md
  assert "| impl |" in stdout, "the run prints its table"
  png = (out / "cpu_memory.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_rerun_merges_rows(smoke, tmp_path):
  out, results, _ = smoke
  path = tmp_path / "cpu.json"
  path.write_text(json.dumps(results))
  _run_smoke(tmp_path, "--impl", "jaxce", "--input", "logits", "--mode", "fwd", "--T", "64,300",
             "--merge")
  merged = json.loads(path.read_text())
  keys = [configs.row_key(r) for r in merged["rows"]]
  assert len(keys) == len(set(keys)), "a re-run duplicated rows"
  assert len(merged["rows"]) == len(results["rows"]) + 1  # T=300 is new, T=64 replaced
  new = [r for r in merged["rows"] if r["impl"] == "jaxce" and r["mode"] == "fwd"
         and r["input"] == "logits" and r["n_devices"] == 1]
  assert sorted(r["T"] for r in new) == [64, 200, 300]
  assert all("commit" in r and "date" in r for r in new)
  # Without --merge the file holds this run's rows only.
  proc = _run_smoke(tmp_path, "--impl", "jaxce", "--input", "logits", "--mode", "fwd",
                    "--T", "64")
  alone = json.loads(path.read_text())
  assert [(r["impl"], r["T"]) for r in alone["rows"]] == [("jaxce", 64)]
  assert _tables(proc.stdout) == _tables((tmp_path / "cpu.md").read_text())[:1]


def test_resume_runs_only_what_is_missing(smoke, tmp_path):
  _, results, _ = smoke
  path = tmp_path / "cpu.json"
  first = [r for r in results["rows"] if r["mode"] == "fwd"]
  path.write_text(json.dumps(dict(results, rows=first)))
  proc = _run_smoke(tmp_path, "--impl", "jaxce:default,jax_plain", "--input", "logits", "--T",
                    "64", "--resume")
  rows = json.loads(path.read_text())["rows"]
  assert {(r["impl"], r["mode"], r["T"]) for r in rows if r["input"] == "logits"
          and r["n_devices"] == 1} >= {("jaxce", "fwd_bwd", 64), ("jax_plain", "fwd_bwd", 64)}
  # fwd_bwd at T = 64 on one device, on two and on the 2 × 2 mesh (the fwd rows are
  # there): five new rows.
  assert [l for l in proc.stdout.splitlines() if l.startswith("resuming")][0].endswith(
      ": 5 configurations left")
  assert len(rows) == len(first) + 5


def _tables(text):
  """The markdown tables in ``text`` (runs of lines that start with ``|``)."""
  tables, current = [], []
  for line in text.splitlines() + [""]:
    if line.startswith("|"):
      current.append(line)
    elif current:
      tables.append("\n".join(current))
      current = []
  return tables


def test_printed_table_is_the_written_table(smoke):
  out, _, stdout = smoke
  printed = _tables(stdout)
  assert len(printed) == 1, "the run prints one table"
  assert printed[0] == _tables((out / "cpu.md").read_text())[0]
  assert f"wrote {os.path.relpath(out / 'cpu.json')}" in stdout


def test_cpu_run_says_why_the_logits_forward_holds_an_f32_copy(smoke):
  from bench.__main__ import CPU_COPY_NOTE
  _, _, stdout = smoke
  assert stdout.count(CPU_COPY_NOTE) == 1


def test_default_destination_is_ignored_and_leaves_the_checkout_clean():
  from bench import __main__ as driver
  assert driver.parse_args([]).out == driver.OUT
  assert driver.parse_args(["--save-results"]).out == driver.RESULTS
  assert driver.parse_args(["--out", "/tmp/x"]).out == "/tmp/x"
  with pytest.raises(SystemExit):
    driver.parse_args(["--save-results", "--out", "/tmp/x"])
  with pytest.raises(SystemExit):
    driver.parse_args(["--suite", "cpu,nope"])
  git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
  if git("rev-parse", "--git-dir").returncode != 0:
    pytest.skip("not a git checkout")
  slug = "test-default-destination"
  assert git("check-ignore", "-q", os.path.join("bench", "out", f"{slug}.json")).returncode == 0
  before = git("status", "--porcelain").stdout
  proc = _run_smoke(None, "--impl", "jaxce", "--input", "logits", "--mode", "fwd", "--T", "64",
                    "--device-slug", slug)
  try:
    assert git("status", "--porcelain").stdout == before, "the default run wrote a tracked file"
    assert f"wrote {os.path.join('bench', 'out', slug + '.json')}" in proc.stdout
  finally:
    for ext in (".json", ".md", "_memory.png"):
      path = os.path.join(driver.OUT, slug + ext)
      if os.path.exists(path):
        os.remove(path)


class _Progress:
  def write(self, _):
    pass

  def update(self, _):
    pass


def test_oom_skips_larger_T_and_missing_peers_start_no_process(monkeypatch):
  from bench import __main__ as driver
  started = []

  def fake_batch(batch, timeout, done):
    for c in batch:
      started.append((c.impl, c.T))
      ok = c.T < 64
      done(c, dict(status="ok" if ok else "oom", ms=1.0 if ok else None,
                   peak_extra_bytes=10 if ok else None,
                   error=None if ok else "RESOURCE_EXHAUSTED: Out of memory"))

  monkeypatch.setattr(driver, "_run_batch", fake_batch)
  monkeypatch.setitem(configs.PEERS, "cce", configs.Peer("a_module_that_is_not_installed",
                                                         "pip install it from somewhere"))
  todo = configs.expand(configs.SUITES["smoke"], impls=["jaxce"], inputs=["logits"],
                        modes=["fwd"], Ts=[32, 64, 200])
  todo.append(configs.Config(impl="cce", input="linear", mode="fwd_bwd", T=64, V=1000, D=32))
  todo.append(configs.Config(impl="jaxce", input="logits", mode="fwd", T=32, V=1000,
                             n_devices=4))
  facts = dict(hbm_GBps=1.0, matmul_tflops={"bfloat16": 1.0}, n_devices=2, platform="gpu")
  rows = driver.run_suite(todo, facts, True, 1, {}, _Progress())
  assert started == [("jaxce", 32), ("jaxce", 64)]
  assert [r["status"] for r in rows] == ["ok", "oom", "oom", "skipped", "skipped"]
  assert rows[4]["error"] == "needs 4 devices, 2 present"  # a one-GPU machine, say
  rows = rows[:4]
  assert "not run: out of memory at T=64" in rows[2]["error"]
  assert rows[3]["skipped"] == "not installed" and rows[3]["peak_extra_bytes"] is None
  assert rows[3]["error"] == ("not installed: cce needs the Python package providing "
                              "'a_module_that_is_not_installed'. To install: pip install it "
                              "from somewhere")
  assert rows[0]["x_floor"] == rows[0]["ms"] / rows[0]["floor_ms"]

  # A not-installed row never replaces a measured one; any other new row does.
  measured = dict(rows[3], status="ok", skipped=None, ms=2.0, peak_extra_bytes=5)
  merged = report.merge({"rows": [measured, dict(rows[0], ms=9.0)]}, {"rows": rows})
  by_impl_T = {(r["impl"], r["T"]): r for r in merged["rows"]}
  assert len(merged["rows"]) == 4
  assert by_impl_T[("cce", 64)]["status"] == "ok"
  assert by_impl_T[("jaxce", 32)]["ms"] == 1.0


def test_gpu_only_peers_are_skipped_on_cpu_with_the_install_hint(monkeypatch):
  """Liger's rows (and every GPU-only peer's) never start a process on CPU: each is a
  "skipped" row whose reason, printed whole, says how to install the peer."""
  from bench import __main__ as driver
  monkeypatch.setattr(driver, "_run_batch", lambda *a: pytest.fail("a process started"))
  todo = configs.expand(configs.SUITES["gpu"] + configs.SUITES["objective"],
                        impls=list(configs.GPU_ONLY_IMPLS), Ts=[64], V=1000, D=32)
  assert {c.impl for c in todo} == set(configs.GPU_ONLY_IMPLS)
  facts = dict(hbm_GBps=1.0, matmul_tflops={"bfloat16": 1.0}, n_devices=1, platform="cpu")
  rows = driver.run_suite(todo, facts, False, 1, {}, _Progress())
  assert all(r["status"] == "skipped" for r in rows)
  flsce = next(r for r in rows if r["impl"] == "liger_flsce")
  assert flsce["error"].startswith("GPU only: liger_flsce runs on a CUDA GPU, this is cpu.")
  assert "pip install liger-kernel==0.8.5 nvidia-cutlass-dsl==4.8.1" in flsce["error"]
  assert "shared" not in flsce["error"]  # (what a user types, nothing of our own machines)
  lines = driver.skipped_lines(rows)
  assert any(flsce["error"] in line for line in lines)
  assert len(lines) == len({r["error"] for r in rows})
  assert "pip install liger-kernel" in report.markdown(dict(device="cpu", n_devices=1, jax="0", hbm_GBps=1.0,
                                              bf16_tflops=1.0, commit="", rows=rows))


def test_time_budget_skips_the_rest(monkeypatch):
  from bench import __main__ as driver
  started = []
  monkeypatch.setattr(driver, "_run_batch", lambda batch, t, done: [
      started.append(c.T) or done(c, dict(status="ok", ms=1.0, peak_extra_bytes=1))
      for c in batch])
  todo = configs.expand(configs.SUITES["smoke"], impls=["jaxce"], inputs=["logits"],
                        modes=["fwd"], Ts=[32, 64])
  facts = dict(hbm_GBps=1.0, matmul_tflops={"bfloat16": 1.0}, n_devices=1, platform="gpu")
  rows = driver.run_suite(todo, facts, True, 1, {}, _Progress(), budget_s=-1)
  assert started == [] and all(r["skipped"] == "time budget" for r in rows)


def test_torch_rows_of_one_peer_share_a_process_on_gpu(monkeypatch):
  from bench import __main__ as driver
  batches = []
  monkeypatch.setattr(driver, "_run_batch", lambda batch, t, done: [
      batches.append([(c.impl, c.T) for c in batch])] + [
          done(c, dict(status="ok", ms=1.0, peak_extra_bytes=1)) for c in batch])
  monkeypatch.setattr(driver, "skip_reason", lambda config, platform: None)
  todo = configs.expand(configs.SUITES["gpu"], impls=["torch_eager", "jaxce:default"],
                        inputs=["linear"], modes=["fwd"])
  facts = dict(hbm_GBps=1.0, matmul_tflops={"bfloat16": 1.0}, n_devices=1, platform="gpu")
  driver.run_suite(todo, facts, True, 1, {}, _Progress())
  assert batches == [[("jaxce", 8192)], [("jaxce", 32768)],
                     [("torch_eager", 8192), ("torch_eager", 32768)]]
  batches.clear()
  driver.run_suite(todo, facts, True, 1, {}, _Progress(), fresh_torch=True)
  assert len(batches) == 4


def test_merged_table_names_each_rows_commit_and_plots_never_mix_shapes():
  base = dict(impl="jaxce", variant="default", input="logits", mode="fwd_bwd", T=64, V=1000,
              D=None, dtype="bfloat16", chunk_size=None, n_devices=1, status="ok", ms=1.0,
              floor_ms=1.0, peak_extra_bytes=2**20)
  rows = [dict(base, commit="a" * 40), dict(base, T=128, commit="b" * 40)]
  table = report.table(rows)
  assert table.splitlines()[0].endswith(" commit |")
  assert "| aaaaaaa |" in table and "| bbbbbbb |" in table
  assert "commit" not in report.table(rows[:1])
  rows.append(dict(base, V=2000, commit="b" * 40))
  rows.append(dict(base, input="linear", D=32, commit="b" * 40))
  assert report.panels(rows) == [("logits", 1000, 0, "bfloat16"),
                                 ("logits", 2000, 0, "bfloat16"),
                                 ("linear", 1000, 32, "bfloat16")]


def test_oom_classification():
  from bench.runner import classify
  assert classify(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")) \
      == "oom"
  assert classify(RuntimeError("CUDA out of memory. Tried to allocate 9.3 GiB")) == "oom"
  assert classify(ValueError("weight must have shape [D, V]")) == "error"


def test_device_slug():
  from bench.__main__ import device_slug
  assert device_slug(dict(platform="cpu", device="cpu", n_devices=8)) == "cpu"
  assert device_slug(dict(platform="gpu", device="NVIDIA H100 80GB HBM3",
                          n_devices=1)) == "nvidia-h100-x1"
  assert device_slug(dict(platform="gpu", device="NVIDIA H200", n_devices=2)) == \
      "nvidia-h200-x2"
  # A suite with a results file of its own names it (README's headline, its sharded table).
  h200 = dict(platform="gpu", device="NVIDIA H200", n_devices=1)
  assert device_slug(h200, "shapes") == "nvidia-h200-x1-shapes"
  assert device_slug(dict(h200, n_devices=4), "gpu-shards") == "nvidia-h200-x4-shards"
  assert device_slug(dict(h200, n_devices=4), "gpu-shards-more") == \
      "nvidia-h200-x4-shards_more"
  assert device_slug(h200, "gpu,objective") == device_slug(h200, "shapes,gpu") == \
      "nvidia-h200-x1"
  for name in configs.RESULTS_NAMES.values():  # the committed files of those names
    assert glob.glob(os.path.join(ROOT, "bench", "results", f"*-{name}.json")), name


def test_impl_filter_selects_variants():
  suite = configs.SUITES["smoke"]
  variants = lambda impls: {(c.impl, c.variant) for c in configs.expand(suite, impls=impls)}
  assert variants(["jaxce:default"]) == {("jaxce", "default")}
  assert variants(["jaxce:default", "jaxce:xla"]) == {("jaxce", "default"), ("jaxce", "xla")}
  every = variants(["jaxce"])
  assert ("jaxce", "inplace") in every and ("jaxce", "default") in every
  assert all(impl == "jaxce" for impl, _ in every)


def test_implementation_variants_pass_the_option():
  """``jaxce:xla`` and ``jaxce:triton`` rows run (and say) ``implementation=...``; other
  impls have no such variant."""
  from bench import impls
  for variant in configs.IMPLEMENTATION_VARIANTS:
    for input_path, D in (("logits", None), ("linear", 16)):
      c = configs.Config(impl="jaxce", input=input_path, mode="fwd", T=8, V=64, D=D,
                         dtype="float32", variant=variant)
      assert c.invalid() is None
      built = impls.build(c, jax.devices()[:1])
      assert f"implementation={variant!r}" in built.note, built.note
  assert "is a jaxce (xla, triton) or tokamax" in configs.Config(
      impl="jax_plain", input="logits", mode="fwd", T=8, V=64, variant="triton").invalid()
  assert configs.Config(impl="jaxce", input="linear", mode="fwd", T=8, V=64, D=8,
                        variant="chunked_xla").invalid()
  for variant in configs.TOKAMAX_VARIANTS:
    assert configs.Config(impl="tokamax", input="linear", mode="fwd", T=8, V=64, D=8,
                          variant=variant).invalid() is None
  assert configs.Config(impl="tokamax", input="linear", mode="fwd", T=8, V=64, D=8).invalid()


def test_sweep_summary_compares_default_with_best_chunk():
  base = dict(impl="jaxce", variant="default", input="logits", mode="fwd_bwd", T=4096,
              V=1000, D=None, dtype="bfloat16", n_devices=1, status="ok")
  rows = [dict(base, chunk_size=None, chunk_used=512, ms=11.0),
          dict(base, chunk_size=256, ms=10.0), dict(base, chunk_size=1024, ms=12.0),
          dict(base, T=64, chunk_size=None, ms=1.0)]  # no sweep at T=64: no line
  lines = report.sweep_summary(rows)
  assert len(lines) == 1
  assert "| 512 | 11.00 | 256 | 10.00 | 1.100 |" in lines[0]


def test_every_result_file_is_read_by_the_docs():
  """Each file in ``bench/results`` is named on the benchmarks page's list of result files
  (docs/benchmarks.md, "The result files") and somewhere else in README or the docs, and
  each file that list names exists: no row set that nothing reads, no dangling name."""
  results = os.path.join(ROOT, "bench", "results")
  with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
    page = f.read()
  listed = set(re.findall(r"`([^`/ ]+\.(?:json|md|png|txt|log))`",
                          page.split("## The result files", 1)[1]))
  present = set(os.listdir(results))
  assert present - listed == set(), f"not in the list of result files: {present - listed}"
  assert listed - present == set(), f"listed but not in bench/results: {listed - present}"
  pages = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")]
  for folder, _, names in os.walk(os.path.join(ROOT, "docs")):
    pages += [os.path.join(folder, n) for n in names if n.endswith(".md")]
  text = ""
  for path in pages:
    with open(path) as f:
      text += f.read().replace(page.split("## The result files", 1)[1], "")
  companions = (".md", "_memory.png")  # written beside a rows file (``bench.report``)
  unread = {name for name in present if name not in text and not any(
      name.endswith(c) and name[:-len(c)] + ".json" in text for c in companions)}
  assert not unread, f"named only in the list, read nowhere: {sorted(unread)}"


def test_benchmark_tables_come_from_the_committed_results():
  """Each table of the benchmarks page (docs/benchmarks.md) marked ``<!-- bench-table
  PATH T=N [chunks] -->`` is exactly what ``python -m bench.report PATH --readme-T N
  [--chunks]`` prints: no number in it is typed by hand."""
  with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
    lines = f.read().splitlines()
  marked = [i for i, line in enumerate(lines) if line.startswith("<!-- bench-table ")]
  assert marked, "the benchmarks page has no generated bench table"
  for i in marked:
    path, t_field, *chunks = lines[i].removeprefix("<!-- bench-table ").removesuffix(
        " -->").split()
    with open(os.path.join(ROOT, path)) as f:
      expected = report.summary_table(json.load(f), int(t_field.removeprefix("T=")),
                                      chunks == ["chunks"])
    table = []
    for line in lines[i + 1:]:
      if not line.startswith("|"):
        break
      table.append(line)
    assert "\n".join(table) == expected, f"the table of {path} is stale: regenerate it"


def test_results_tables_come_from_their_rows():
  """Each ``bench/results/<slug>.md`` of a results file in the bench's schema (its rows,
  device and floors) is exactly what ``python -m bench.report <slug>.json`` writes: a
  table is not left behind when rows are merged into its file."""
  folder = os.path.join(ROOT, "bench", "results")
  checked = []
  for name in sorted(os.listdir(folder)):
    results = report.load(os.path.join(folder, name[:-3] + ".json")) if name.endswith(
        ".md") else None
    if not results or not isinstance(results.get("rows"), list) or "hbm_GBps" not in results:
      continue
    with open(os.path.join(folder, name)) as f:
      assert f.read().strip() == report.markdown(results).strip(), (
          f"bench/results/{name} is stale: python -m bench.report "
          f"bench/results/{name[:-3]}.json")
    checked.append(name)
  assert "nvidia-h200-x4-shards.md" in checked and "cpu.md" in checked, checked


def test_readme_headline_comes_from_the_committed_results():
  """The headline blocks (``<!-- headline-KIND PATH -->`` ... ``<!-- /headline -->``) of
  README (the compact table, the sharded rows), of the benchmarks page (every shape,
  the GRPO step, the sharded rows of another host) and of the sharded guide (time per
  column at ragged widths) are exactly what ``python -m bench.headline`` makes of the committed
  rows, and the chart they cite is committed."""
  from bench import headline
  want = {"README.md": {"headline-compact", "headline-shards"},
          "docs/benchmarks.md": {"headline-shapes", "headline-grpo", "headline-shards"},
          "docs/guides/sharded.md": {"headline-widths"}}
  assert set(headline.PAGES) == set(want)
  for page, kinds in want.items():
    with open(os.path.join(ROOT, page)) as f:
      text = f.read()
    found = headline.blocks(text)
    assert {re.search(r"<!-- (headline-\w+) ", text.splitlines()[start - 1])[1]
            for start, _, _ in found} == kinds, f"{page}'s headline blocks are missing"
    lines = text.splitlines()
    for start, end, block in found:
      assert "\n".join(lines[start:end]) == block, (
          f"{page}'s headline is stale: python -m bench.headline --write")
    if page != "docs/guides/sharded.md":
      assert headline.CHART.split("/")[-1] in text
  assert os.path.exists(os.path.join(ROOT, headline.CHART))
  with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
    assert headline.SHARDS_CHART.split("/")[-1] in f.read()
  assert os.path.exists(os.path.join(ROOT, headline.SHARDS_CHART))


def _shapes_row(impl, T, ms, commit="aaaaaaa", mode="fwd_bwd", peak_gib=1.0):
  """A ``bench --suite shapes`` row as the headline reads it (V = 151936, D = 1024)."""
  return dict(impl=impl, variant="default", mode=mode, status="ok", V=151936, D=1024, T=T,
              ms=ms, commit=commit, peak_extra_bytes=peak_gib * 2**30)


def test_headline_ratios_compare_rows_of_one_run():
  """A results file merged from several runs (shapes remeasured after a change replace
  their rows): the headline divides jaxce's time by FLSCE's, and a ragged T's per token by
  its round T's, only where both rows come from the same commit; else "–"."""
  from bench import headline
  row = _shapes_row
  results = dict(rows=[row("jaxce", 8184, 10.0, "aaaaaaa"), row("liger_flsce", 8184, 20.0,
                                                                  "aaaaaaa"),
                       row("jaxce", 8192, 10.0, "bbbbbbb"), row("liger_flsce", 8192, 20.0,
                                                                  "ccccccc")])
  lines = headline.shapes_table(results).splitlines()[2:]
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
  assert [c[2] for c in cells] == ["8184", "8192"]
  assert cells[0][5] == "0.500" and cells[0][6] == "–"  # 8192's row is another run's
  assert cells[1][5] == "–" and cells[1][6] == "round"


def test_headline_pools_runs_of_one_shape():
  """A shape run several times (fresh processes, one commit) shows its runs' median time and
  largest peak, marked "(n)" with a line under the table saying what that means; runs of
  one shape from two commits are an error, not a silent mix."""
  from bench import headline
  row = lambda impl, ms, peak, commit="aaaaaaa": _shapes_row(impl, 8184, ms, commit,
                                                             peak_gib=peak)
  forward = lambda T, ms: _shapes_row("jaxce", T, ms, mode="fwd", peak_gib=0.1)
  results = dict(rows=[row("jaxce", 97.0, 2.5), row("jaxce", 99.0, 2.4),
                       row("jaxce", 95.0, 2.6), row("liger_flsce", 100.0, 2.0),
                       forward(8184, 30.0), forward(8184, 20.0), forward(8184, 25.0),
                       forward(8192, 25.0)])
  table = headline.shapes_table(results).splitlines()
  cells = [c.strip() for c in table[2].strip("|").split("|")]
  assert cells[3:6] == ["97.0 (3)", "100.0", "0.970"]
  assert cells[8] == "25.0 (3)" and cells[10] == f"{8192 / 8184:.3f} (of 8192)"
  assert cells[11].startswith("2.60 / 2.00")
  assert table[-1].startswith("A time with (n) after it is the median of n runs")
  assert "median" not in headline.shapes_table(dict(rows=results["rows"][2:5]))
  results["rows"].append(row("jaxce", 90.0, 2.5, commit="bbbbbbb"))
  with pytest.raises(ValueError, match="commits"):
    headline.shapes_table(results)


def test_gpu_only_code_compiles_and_imports_on_cpu():
  """Every GPU-only path is at least compiled and imported here: the session script, the
  floors, the accuracy rows, the PyTorch peers, the kernel pieces the floors time and the
  Mosaic check script that prints them too, and bench's other GPU measurements."""
  import importlib  # pylint: disable=reimported
  import py_compile
  for folder in ("bench", "scripts"):
    for name in os.listdir(os.path.join(ROOT, folder)):
      if name.endswith(".py"):
        py_compile.compile(os.path.join(ROOT, folder, name), doraise=True)
  bash = subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", "gpu_session.sh")],
                        capture_output=True, text=True)
  assert bash.returncode == 0, bash.stderr
  for module in ("bench.machine_floors", "bench.accuracy", "bench.impls_torch",
                 "bench.kernel_pieces", "bench.batch_invariant", "bench.invariant_cost",
                 "bench.precision", "scripts.gpu_check_mosaic_linear"):
    importlib.import_module(module)
  from bench import impls_torch
  assert callable(impls_torch.flsce(True)) if importlib.util.find_spec("liger_kernel") else True


def test_bench_imports_nothing_from_scripts():
  """Imports run one way: ``scripts/`` (the GPU checks) may import ``bench``, no module of
  ``bench/`` imports ``scripts`` (inside functions neither)."""
  import ast
  offenders = []
  for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
    if not name.endswith(".py"):
      continue
    with open(os.path.join(ROOT, "bench", name)) as f:
      tree = ast.parse(f.read(), name)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        modules = [node.module or ""] if node.level == 0 else []
      else:
        continue
      offenders += [f"{name}:{node.lineno} {m}" for m in modules
                    if m == "scripts" or m.startswith("scripts.")]
  assert offenders == [], offenders


def test_accuracy_rows_on_cpu():
  """The accuracy rows where the tests run: jaxce's f32 statistics of bf16 operands within
  1e-4 of float64; plain JAX as close on CPUs (XLA:CPU rounds its bf16 logits from f32
  sums too), no closer than jaxce on GPUs (there its logits come out of the matmul in
  bf16)."""
  from bench import accuracy
  result = accuracy.measure(("jaxce", "jaxce:objective", "jax_plain", "liger_flsce"), 16, 1000,
                            32, platform=jax.default_backend())
  rows = {report.name(r): r for r in result["rows"]}
  for name in ("jaxce", "jax_plain"):
    r = rows[name]
    assert r["status"] == "ok", r
    assert 0 < r["d_hidden"] < 2**-6 and 0 < r["d_W"] < 2**-6, r  # bf16 gradients
  assert rows["jaxce"]["logp"] < 1e-4 and rows["jaxce"]["entropy"] < 1e-4, rows["jaxce"]
  plain = rows["jax_plain"]
  if jax.default_backend() == "cpu":
    assert plain["logp"] < 1e-4 and plain["entropy"] < 1e-4, plain
  else:
    assert plain["logp"] >= rows["jaxce"]["logp"], plain
  assert rows["jaxce:objective"]["logp"] is None and rows["jaxce:objective"]["d_W"] < 2**-6
  if importlib.util.find_spec("liger_kernel") is None:  # (where it is installed, it runs)
    assert rows["liger_flsce"]["status"] == "skipped"
    assert "pip install liger-kernel" in rows["liger_flsce"]["error"]
  else:
    assert rows["liger_flsce"]["status"] == "ok", rows["liger_flsce"]
  md = report.accuracy_markdown(result)
  assert "| jaxce |" in md and "max |gradient - float64 gradient|" in md
  row = dict(impl="jaxce", variant="default", input="linear", mode="fwd_bwd", T=16, V=1000,
             D=32, dtype="bfloat16", chunk_size=None, n_devices=1, status="ok", ms=1.0,
             floor_ms=1.0, peak_extra_bytes=1, commit="")
  table = report.table([row], result)
  assert "error vs f64 at T=16" in table.splitlines()[0] and "e-0" in table.splitlines()[2]


def test_accuracy_reference_in_chunks_of_tokens():
  """The float64 reference taken a few tokens at a time (ragged chunks of 5 of 13, as it
  takes 2048 of T = 32768 on a GPU) is the one-chunk reference: ``d W`` summed over the
  chunks, every token's outputs and ``d hidden`` rows in order."""
  from bench import accuracy
  problem = accuracy.host_problem(13, 300, 16)
  whole, chunked = (accuracy.reference(problem, 0.01, rows=r) for r in (13, 5))
  for key in ("logp", "entropy", "d_hidden", "d_W"):
    np.testing.assert_allclose(chunked[key], whole[key], rtol=1e-6, atol=1e-12, err_msg=key)
  assert chunked["d_hidden"].shape == (13, 16) and chunked["d_W"].shape == (16, 300)


def test_machine_floors_on_cpu():
  """The floors' XLA GEMM and copy run here; cuBLAS and Mosaic say they need a GPU; a
  row's floor from the machine's best adds the four GEMMs of the fused path."""
  from bench import __main__ as driver
  from bench import machine_floors as mf
  assert mf.time_gemm("xla", 64, 32, 128, 2) > 0 and mf.time_copy("xla", 64, 128, 2) > 0
  target = jaxce.plan.target()
  for backend in ("cublas", "mosaic"):
    row = mf._attempt(mf.time_gemm, backend, 256, 128, 256, 2)  # (Mosaic: rows of 256)
    runs_here = target.platform == "gpu" and (backend == "cublas" or target.capability == "9.0")
    if runs_here:  # (on a GPU: cuBLAS through PyTorch, Mosaic on Hopper)
      assert row["status"] == "ok" and row["ms"] > 0, row
    else:
      assert row["status"] == "skipped" and row["ms"] is None, row
  assert mf.datasheet_peak("NVIDIA H200") == mf.datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4
  floors = [dict(T=1024, shape=s, backend="xla", ms=ms, tflops=1.0, x_peak=None)
            for s, ms in zip(mf.SHAPES, (1.0, 2.0, 3.0))]
  gemm = [dict(T=1024, shape=s, M=1, K=1, N=1, backend=b, ms=1.0, tflops=1.0, status="ok")
          for s in mf.SHAPES for b in mf.BACKENDS]
  result = dict(V=1000, D=32, floors=floors, gemm=gemm, copy=[dict(T=1024, backend="xla",
                                                                  ms=1.0, GBps=100.0)], ours=[])
  c = configs.Config(impl="jaxce", input="linear", mode="fwd_bwd", T=2048, V=1000, D=32)
  assert mf.floor_ms(c, result) == 2 * (2 * 1.0 + 2.0 + 3.0)
  assert mf.floor_ms(dataclasses_replace(c, mode="fwd"), result) == 2.0
  logits = configs.Config(impl="jaxce", input="logits", mode="fwd_bwd", T=2048, V=1000)
  assert mf.floor_ms(logits, result) == 3 * 2048 * 1000 * 2 / 100e6
  assert mf.floor_ms(dataclasses_replace(c, V=999), result) is None
  assert "| 1024 | h @ W |" in mf.markdown(result)
  facts = dict(hbm_GBps=1.0, matmul_tflops={"bfloat16": 1.0}, machine_floors=result)
  row = driver.finish_row(c, dict(status="ok", ms=28.0, peak_extra_bytes=1), facts, {})
  assert row["floor_source"] == "machine_best" and row["x_floor"] == 2.0


def dataclasses_replace(config, **kw):
  import dataclasses
  return dataclasses.replace(config, **kw)


def test_merge_into_rewrites_the_results_file(tmp_path):
  base = dict(impl="jaxce", variant="default", input="logits", mode="fwd_bwd", T=64, V=1000,
              D=None, dtype="bfloat16", chunk_size=None, n_devices=1, status="ok", ms=1.0,
              floor_ms=1.0, peak_extra_bytes=2**20)
  top = dict(device="cpu", n_devices=1, jax="0", hbm_GBps=1.0, bf16_tflops=1.0)
  old, new = tmp_path / "old.json", tmp_path / "new.json"
  old.write_text(json.dumps(dict(top, commit="a" * 40, rows=[dict(base, commit="a" * 40),
                                                             dict(base, T=8, commit="a" * 40)])))
  new.write_text(json.dumps(dict(top, commit="b" * 40, rows=[dict(base, ms=2.0,
                                                                  commit="b" * 40)])))
  report.main([str(new), "--merge-into", str(old)])
  merged = json.loads(old.read_text())
  assert sorted((r["T"], r["ms"]) for r in merged["rows"]) == [(8, 1.0), (64, 2.0)]
  assert "| bbbbbbb |" in (tmp_path / "old.md").read_text()


def test_torch_peers_are_timed_after_their_compiling_call():
  """A peer that compiles on its first call gets the timed calls its warm-up's time
  allows, not one call judged from the compile."""
  from bench import impls_torch
  calls, events = [], []

  def call():
    calls.append(None)
    time.sleep(0.3 if len(calls) == 1 else 0.001)  # the first call compiles
    return len(calls)

  times = impls_torch.time_after_first_call(
      call, sync=lambda out: None, after=lambda: events.append("after"), repeats=5,
      budget_s=0.1, between=lambda: events.append("between"))
  assert len(times) == 5 and max(times) < 100  # the compiling call is not among them
  assert len(calls) == 7  # compile, warm-up, 5 timed
  assert events[:2] == ["after", "between"] and events.count("between") == 1


def test_a_slow_warm_up_does_not_cut_the_timed_calls_to_one():
  """A warm-up call that pays a one-time cost (NCCL's first collective on a mesh) leaves
  the timed calls their budget: the count is judged from the fastest call so far, so a
  fast call gets all its repeats and a slow one still stops at the budget."""
  from bench.timing import time_calls
  for first, then, expected in ((0.3, 0.001, 5), (0.3, 0.06, 1), (0.001, 0.06, 1)):
    calls = []

    def call(first=first, then=then):
      calls.append(None)
      time.sleep(first if len(calls) == 1 else then)

    times = time_calls(call, (), repeats=5, budget_s=0.1, sync=lambda out: None)
    assert len(times) == expected, (first, then, times)


def test_grpo_step_suite_tiny(tmp_path):
  """``python -m bench.grpo_step --tiny``: the GRPO step of a tiny flax model on CPU, each
  path in its own process (the fused objective path, which the suite adds to
  ``examples.gpu_run``, and plain JAX, the ratios' base; the other paths' steps are
  tests/test_examples.py's), on one device and on a 2 x 2 (data x vocab) mesh of simulated
  devices, and on the mesh in the sequence-parallel layout (``2x2:sp``): a row per mesh
  and path, a table per mesh against plain and, for the meshes, against one device."""
  from examples.gpu_run import PATHS
  assert PATHS == ("objective", "linear", "plain", "logits")
  paths = ("objective", "plain")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "bench.grpo_step", "--tiny", "--sizes", "small",
                         "--paths", ",".join(paths), "--meshes", "1x1,2x2,2x2:sp", "--out",
                         str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  results = json.loads((tmp_path / "cpu-grpo_step.json").read_text())
  assert [(r["size"], r["mesh"], r.get("sequence_parallel", False), r["path"])
          for r in results["rows"]] == [("small", mesh, parallel, p) for mesh, parallel in
                                        (([1, 1], False), ([2, 2], False), ([2, 2], True))
                                        for p in paths]
  for r in results["rows"]:
    assert r["error"] is None and r["step_ms_median"] > 0 and r["score_ms_median"] > 0, r
    assert r["tokens_per_step"] == 4 * 63 and r["first_step_s"] > 0, r
    assert r["attention"] == "xla", r
  assert set(results["gpu_run"]) == {"small 1x1", "small 2x2", "small 2x2:sp"}
  for name, parallel in (("small 2x2", False), ("small 2x2:sp", True)):
    assert [(res["mesh"], res["sequence_parallel"])
            for res in results["gpu_run"][name]["results"]] == [([2, 2], parallel)] * 2
  assert results["device"] == "cpu" and results["vocab"] == 4096 and results["jax"]
  assert results["num_devices"] == 4
  md = (tmp_path / "cpu-grpo_step.md").read_text()
  assert "| path | step ms | × plain JAX step |" in md and "| plain | " in md
  assert "4 device(s): 2 × 2 (data × vocab)" in md and "| step × 1 device |" in md
  assert md.count("| step × 1 device |") == 2 and md.count(", sequence parallel (") == 1
  assert md.strip() in proc.stdout


def test_grpo_step_largest_batch_doubles_until_out_of_memory(monkeypatch):
  """Each try doubles the sequences: stops at the first out-of-memory size, at 8 x, or at the
  deadline; a plain row that failed leaves the ratios "–" and says why under the table."""
  from bench import grpo_step
  tries = []

  def fake_gpu_run(size, paths, timeout, mesh=None):
    tries.append(size["sequences"])
    oom = size["sequences"] > limit
    return dict(results=[dict(path=paths[0], error="exit 1: RESOURCE_EXHAUSTED: Out of memory"
                              if oom else None)])

  monkeypatch.setattr(grpo_step, "gpu_run", fake_gpu_run)
  size, row, later = dict(sequences=8), dict(path="plain", error=None), time.monotonic() + 99
  limit = 16
  assert grpo_step.largest_batch(size, row, later) == dict(
      largest_sequences_ok=16, first_sequences_failed=32, largest_batch_stop="oom")
  assert tries == [16, 32]
  tries.clear()
  limit = 1000
  assert grpo_step.largest_batch(size, row, later)["largest_sequences_ok"] == 64  # 8 x: cap
  assert tries == [16, 32, 64]
  tries.clear()
  failed = dict(row, error="RESOURCE_EXHAUSTED: Out of memory")
  assert grpo_step.largest_batch(size, failed, later) == dict(
      largest_sequences_ok=None, first_sequences_failed=8, largest_batch_stop="oom")
  assert grpo_step.largest_batch(size, row, time.monotonic())["largest_batch_stop"] == \
      "time budget" and tries == []
  # A failed plain row: the other rows' ratios are "–".
  rows = [dict(size="small", path=p, d_model=1, layers=1, heads=1, sequences=8, seq_len=2,
               tokens_per_step=8, step_ms_median=1.0, score_ms_median=1.0,
               peak_bytes_in_use=2**30, peak_minus_before=2**29, error=None)
          for p in ("objective", "plain")]
  rows[1].update(step_ms_median=None, score_ms_median=None, peak_bytes_in_use=None,
                 peak_minus_before=None, error=failed["error"])
  md = grpo_step.markdown(dict(num_devices=1, device="d", jax="0", flax="0", commit="",
                               date="", vocab=8, rows=rows))
  assert "| objective | 1.0 | – | 1.0 | – | 1.00 | – | 0.50 | – |" in md
  assert "plain failed: out of memory" in md


def test_grpo_step_merge_keeps_the_sizes_not_rerun():
  """``--merge``: the destination's other sizes come first, each row with the commit it ran
  at (the table names a size's commit when it is not the file's), and so do a size's
  meshes that the run does not redo; another device or vocabulary is refused."""
  from bench import grpo_step
  facts = dict(device="d", num_devices=1, jax="0", flax="0", vocab=8, tiny=False, date="")
  row = lambda size, path, commit=None: dict(
      size=size, path=path, d_model=1, layers=1, heads=1, sequences=8, seq_len=2,
      tokens_per_step=8, step_ms_median=1.0, score_ms_median=1.0, peak_bytes_in_use=2**30,
      peak_minus_before=2**29, error=None, **({} if commit is None else dict(commit=commit)))
  old = dict(facts, commit="aaaaaaaa", sizes=dict(small={}, medium={}),
             rows=[row("small", "plain"), row("medium", "plain")],
             gpu_run=dict(small={}, medium={}))
  new = dict(facts, commit="bbbbbbbb", sizes=dict(medium={"x": 1}),
             rows=[row("medium", "plain", "bbbbbbbb")], gpu_run=dict(medium={"x": 1}))
  got = grpo_step.merged(old, new)
  assert list(got["sizes"]) == ["small", "medium"] and got["sizes"]["medium"] == {"x": 1}
  assert [(r["size"], r["commit"]) for r in got["rows"]] == [("small", "aaaaaaaa"),
                                                             ("medium", "bbbbbbbb")]
  assert got["commit"] == "bbbbbbbb" and list(got["gpu_run"]) == ["small", "medium"]
  md = grpo_step.markdown(got)
  assert "V = 8 (commit aaaaaaa)" in md and "V = 8 (commit bbbbbbb)" not in md
  with pytest.raises(SystemExit, match="device"):
    grpo_step.merged(dict(old, device="other"), new)
  # --attention: a file holds one attention (files before the flag: XLA's), named by size
  with pytest.raises(SystemExit, match="attention"):
    grpo_step.merged(old, dict(new, attention="cudnn"))
  assert grpo_step.merged(old, dict(new, attention="xla"))["rows"] == got["rows"]
  cudnn = dict(got, rows=[dict(r, attention="cudnn") for r in got["rows"]])
  assert "1 heads (cudnn attention), 8 × 2" in grpo_step.markdown(cudnn)
  assert "attention" not in md
  # Meshes: a run of one mesh of a size replaces that mesh's table alone.
  on = lambda mesh, commit, parallel=False: dict(
      row("medium", "plain", commit), mesh=list(mesh),
      **({"sequence_parallel": True} if parallel else {}))
  old = dict(facts, commit="aaaaaaaa", sizes=dict(medium={}),
             rows=[on((1, 1), "aaaaaaaa"), on((2, 2), "aaaaaaaa")],
             gpu_run={"medium 1x1": {}, "medium 2x2": {}})
  new = dict(facts, commit="bbbbbbbb", sizes=dict(medium={}),
             rows=[on((2, 2), "bbbbbbbb"), on((2, 2), "bbbbbbbb", True)],
             gpu_run={"medium 2x2": {"x": 1}, "medium 2x2:sp": {}})
  got = grpo_step.merged(old, new)
  assert [(r["mesh"], r.get("sequence_parallel", False), r["commit"]) for r in got["rows"]] == [
      ([1, 1], False, "aaaaaaaa"), ([2, 2], False, "bbbbbbbb"), ([2, 2], True, "bbbbbbbb")]
  assert got["gpu_run"] == {"medium 1x1": {}, "medium 2x2": {"x": 1}, "medium 2x2:sp": {}}
  md = grpo_step.markdown(got)
  assert md.count("(commit aaaaaaa)") == 1 and md.count(", sequence parallel (") == 1


def test_precision_table_comes_from_the_committed_results():
  """The benchmarks page's float32 precision table (``<!-- precision-table PATH -->``) is
  exactly what ``bench.precision.table`` makes of the committed run."""
  from bench import precision
  with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
    page = f.read()
  marker = "<!-- precision-table "
  assert marker in page, "the benchmarks page has no precision table"
  path = page.split(marker, 1)[1].split(" -->", 1)[0]
  with open(os.path.join(ROOT, path)) as f:
    expected = precision.table(json.load(f))
  assert page.split(f"{marker}{path} -->\n", 1)[1].startswith(expected), "stale: regenerate it"


def test_widths_every_mode_on_cpu(tmp_path):
  """``python -m bench.widths`` runs each path at a ragged width and its round neighbour
  (tiny shapes on CPU: 200 columns against 256, the first width above in whole-tile
  segments, 2 of 128) and saves each row, with the commit, as it finishes."""
  from bench import widths
  out = tmp_path / "widths.json"
  widths.main(["--V", "200", "--mode", "fwd,fwd_bwd,objective,logits,logits_fwd", "--T",
               "64", "--D", "32", "--repeats", "1", "--rounds", "2", "--out", str(out)])
  with open(out) as f:
    saved = json.load(f)
  assert [r["mode"] for r in saved["rows"]] == ["fwd", "fwd_bwd", "objective", "logits",
                                                "logits_fwd"]
  for row in saved["rows"]:
    assert (row["V"], row["V_round"], row["commit"]) == (200, 256, saved["commit"])
    assert row["timed_calls"] == 2  # (a round of each width, then another)
    assert row["ms"] > 0 and row["ms_round"] > 0
    assert row["per_column"] == pytest.approx((row["ms"] / 200) / (row["ms_round"] / 256))


def test_widths_time_a_shard_in_its_own_segments(tmp_path):
  """``--V 2304/4`` times a shard of 2304 columns over 4 devices: a local call at 576
  columns whose kernels tile them as that shard does (2 of the vocabulary's 8 segments of
  288), where a local call at 576 is 4 segments of 144 (as Llama 3's 128256 over 4 GPUs
  is 2 segments of 16032 a shard, and a local call at 32064 is 4 of 8016). The row says
  so (``shards``), and is a shape of its own when merged."""
  from bench import widths
  from jaxce._kernels import logits_rows
  from jaxce._kernels.mosaic import tile
  assert widths.parse_width("2304/4") == (576, 4) and widths.parse_width("576") == (576, 1)
  with pytest.raises(ValueError, match="2305 does not split over 4"):
    widths.parse_width("2305/4")
  assert logits_rows.layout(576, None) == tile.Segments(144, 4, 4)
  with widths._tiled_as_shard(576, 4):  # pylint: disable=protected-access
    assert logits_rows.layout(576, None) == tile.Segments(288, 2, 8)
    assert logits_rows.layout(640, None) == tile.segments(640)
  assert logits_rows.layout(576, None) == tile.Segments(144, 4, 4)
  out = tmp_path / "widths.json"
  widths.main(["--V", "2304/4,576", "--mode", "fwd", "--T", "64", "--D", "32", "--repeats",
               "1", "--rounds", "1", "--out", str(out)])
  with open(out) as f:
    rows = json.load(f)["rows"]
  round_columns = widths.round_width(576)
  assert [(r["V"], r["shards"], r["V_round"]) for r in rows] == [(576, 4, round_columns),
                                                                (576, 1, round_columns)]
  assert len({widths.row_key(r) for r in rows}) == 2


def test_widths_rows_merge_by_shape(tmp_path):
  """``--merge-into`` replaces the committed rows of the shapes run (mode, T, D, V) in
  their place, keeps the others with their commits, and appends new shapes."""
  from bench import widths
  results = tmp_path / "results.json"
  old_rows = [dict(mode=m, T=64, D=32, V=v, ms=1.0, commit="old") for m, v in
              [("fwd", 200), ("fwd_bwd", 200), ("fwd", 136)]]
  with open(results, "w") as f:
    json.dump(dict(device="old", commit="old", rows=old_rows), f)
  widths.main(["--V", "200", "--mode", "fwd,objective", "--T", "64", "--D", "32",
               "--repeats", "1", "--rounds", "1", "--merge-into", str(results)])
  with open(results) as f:
    merged = json.load(f)
  assert [(r["mode"], r["V"]) for r in merged["rows"]] == [
      ("fwd", 200), ("fwd_bwd", 200), ("fwd", 136), ("objective", 200)]
  commits = [r["commit"] for r in merged["rows"]]
  assert commits[1:3] == ["old", "old"] and commits[0] == commits[3] == merged["commit"] != "old"
  assert merged["rows"][0]["ms"] != 1.0 and merged["device"] != "old"


def test_head_profile_shards_trace_on_cpu():
  """``bench.head_profile``'s ``shards-trace`` section times every sharded path at every
  GPU count asked for (here simulated CPU devices: no GPU events), GPU 0's busy time is
  the union of its kernels' intervals, and kernels are sorted by kind. Needs 2 devices
  (CI's CPU run has 8 simulated ones; a one-GPU host skips it)."""
  from bench import head_profile
  devices(2)
  rows = head_profile.shards_trace(64, 32, 256, [1, 2], 1)
  calls = [r for r in rows if r["piece"] == "call"]
  assert {(r["path"], r["n"]) for r in calls} == {
      (p, n) for p in ("fused", "objective", "logits") for n in (1, 2)}
  assert all(r["ms"] > 0 for r in calls), calls
  events = [("a", 0, 10), ("b", 5, 10), ("c", 20, 5), ("d", 21, 1)]
  assert head_profile._busy_ms(events) == pytest.approx(0.020)
  assert head_profile._gaps_ms(events) == pytest.approx(0.005)  # (15 to 20 us)
  assert head_profile._gaps_ms([]) == 0.0
  assert {r["piece"] for r in rows} >= {"GPU 0 busy", "GPU 0 gaps"}
  kinds = {name: head_profile._kind(name) for name in (
      "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "sm90_xmma_gemm_bf16bf16_bf16f32",
      "loop_multiply_fusion", "jaxce_merge_tiles", "_mosaic_kernel")}
  assert kinds == {"ncclDevKernel_AllReduce_Sum_f32_RING_LL": "NCCL",
                   "sm90_xmma_gemm_bf16bf16_bf16f32": "cuBLAS", "loop_multiply_fusion": "XLA",
                   "jaxce_merge_tiles": "Mosaic and others",
                   "_mosaic_kernel": "Mosaic and others"}


def test_data_by_vocab_mesh_rows(smoke):
  """A ``data`` × vocab mesh is a jaxce row over ``data`` × at least 2 devices, a row of its
  own (``row_key``; rows from before the field are ``data = 1``); the smoke suite's 2 × 2
  rows run, plan their chunk on one data shard's tokens, and name their mesh in tables."""
  import dataclasses
  row = configs.Config("jaxce", "linear", "fwd_bwd", T=200, V=1000, D=32, n_devices=4, data=2)
  assert row.invalid() is None
  for bad in (dict(impl="jax_plain"), dict(n_devices=2), dict(n_devices=6, data=4),
              dict(variant="token_split")):
    assert "data" in dataclasses.replace(row, **bad).invalid(), bad
  flat = dataclasses.replace(row, data=1)
  assert configs.row_key(row) != configs.row_key(flat)
  assert configs.row_key({k: v for k, v in dataclasses.asdict(flat).items() if k != "data"}) \
      == configs.row_key(flat)
  _, results, _ = smoke
  meshes = [r for r in results["rows"] if r.get("data", 1) > 1]
  assert {(r["input"], r["variant"]) for r in meshes} == {
      ("linear", "default"), ("linear", "objective_grpo"), ("logits", "default")}
  assert all(r["status"] == "ok" and r["n_devices"] == 4 for r in meshes), meshes
  assert all(r["chunk_used"] <= r["T"] // 2 for r in meshes if r["chunk_used"]), meshes
  assert report.devices(meshes[0]) == "4 (2 × 2)" and report.devices(dict(n_devices=2)) == "2"
