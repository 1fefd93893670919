"""``python -m bench``: run a suite, write its rows to bench/out/<device>.json (.md, .png).

    python -m bench                                  # the small CPU suite (~2 min)
    python -m bench --suite gpu,objective            # see bench/README.md for GPU runs
    python -m bench --suite cpu --impl jaxce,jax_plain --T 1024,4096 --mode fwd_bwd
    python -m bench --save-results --merge           # into bench/results/, the committed files

One process probes the device and measures the floors; then every configuration runs in
a fresh process (``python -m bench.runner``), because peak device memory can only be read
per process. On CPU, where the memory figure is XLA's compiled plan, not a peak, the JAX
configurations share one process unless ``--fresh`` is given; on a GPU the rows of one
PyTorch peer share one process (its peak is reset per row) unless ``--fresh``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import metadata

from bench import configs, floors, inputs, report
from bench.configs import Config, skip_reason
from bench.runner import PROBE_PREFIX, ROW_PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")  # committed: written with --save-results
OUT = os.path.join(ROOT, "bench", "out")  # ignored by git: the default destination
ROW_TIMEOUT_S = 900
# Printed on CPU under a table with the logits forward (bench/NOTES.md, entry 0).
CPU_COPY_NOTE = (
    "note: on CPU the logits forward's plan holds an f32 copy of the logits (x logits = 2): "
    "XLA's CPU compiler hoists the f32 upcast out of the chunk loop; the GPU plan, which "
    "holds none, is the target (bench/results/nvidia-h200-x1.md)")
VERSIONS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "numpy", "torch",
            "triton", "tokamax", "liger-kernel", "nvidia-cutlass-dsl", "cut-cross-entropy",
            "optax")


def _list(text, cast=str):
  if text is None:
    return None
  return [None if v.strip().lower() == "none" else cast(v.strip()) for v in text.split(",")]


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
  p.add_argument("--suite", default=configs.DEFAULT_SUITE,
                 help=f"comma list of: {', '.join(sorted(configs.SUITES))}")
  p.add_argument("--impl", help="comma list of impl or impl:variant names to keep")
  p.add_argument("--input", help="comma list: logits,linear")
  p.add_argument("--mode", help="comma list: fwd,fwd_bwd")
  p.add_argument("--T", help="comma list of token counts (replaces the suite's)")
  p.add_argument("--V", type=int, help="vocabulary size (replaces the suite's)")
  p.add_argument("--D", type=int, help="hidden size of the linear path")
  p.add_argument("--dtype", choices=sorted(inputs.DTYPES))
  p.add_argument("--chunk-size", help="comma list of chunk sizes; 'none' = the default")
  p.add_argument("--repeats", type=int, default=5, help="timed calls at most (default 5)")
  p.add_argument("--repeat-seconds", type=float,
                 help="seconds of timed calls per config, at most (default 2)")
  add_destination(p)
  p.add_argument("--merge", action="store_true",
                 help="keep the destination file's rows that this run does not redo (the "
                 "table then names each row's commit)")
  p.add_argument("--device-slug", help="results file name (default from the device, and "
                 "for shapes, gpu-shards or gpu-shards-more alone the suite's results name)")
  p.add_argument("--fresh", action="store_true",
                 help="one process per config, on CPU and for the PyTorch peers too")
  p.add_argument("--timeout", type=int, default=ROW_TIMEOUT_S, help="seconds per process")
  p.add_argument("--budget-s", type=float,
                 help="start nothing after this many seconds from the start of the run "
                 "(rows not started: skipped, 'time budget'; floors and accuracy get what "
                 "is left)")
  p.add_argument("--resume", action="store_true",
                 help="with the destination file's rows (as --merge), run only the configs "
                 "it has no 'ok' row for, and the floors / accuracy only if it lacks them")
  p.add_argument("--accuracy", action="store_true",
                 help="also the accuracy vs float64 of every fused-path impl (GPU; "
                 "python -m bench.accuracy)")
  p.add_argument("--machine-floors", action="store_true",
                 help="first measure the floors at the machine's best (GPU; python -m "
                 "bench.machine_floors): the rows' floor_ms come from them")
  p.add_argument("--list", action="store_true", help="print the configs and exit")
  args = p.parse_args(argv)
  unknown = [s for s in args.suite.split(",") if s not in configs.SUITES]
  if unknown:
    p.error(f"unknown suite {unknown}; choose from {sorted(configs.SUITES)}")
  resolve_destination(p, args)
  return args


def add_destination(p):
  """``--out`` and ``--save-results``: where a run writes its results."""
  p.add_argument("--out", help="results directory (default bench/out, ignored by git)")
  p.add_argument("--save-results", action="store_true",
                 help="write into bench/results/, the committed results (not with --out)")


def resolve_destination(p, args):
  """``args.out`` set to the directory ``add_destination``'s options name (bench/results
  with ``--save-results``, else ``--out`` or bench/out); both together are an error."""
  if args.save_results and args.out:
    p.error("--save-results writes into bench/results; --out names another directory")
  args.out = RESULTS if args.save_results else (args.out or OUT)


def child_env(n_devices: int) -> dict:
  """The environment of a runner: no preallocation, ``n_devices`` host devices if CPU."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  flags = env.get("XLA_FLAGS", "")
  if n_devices > 1 and "xla_force_host_platform_device_count" not in flags:
    # Only the CPU backend reads this: simulated devices for the sharded rows there.
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_devices}".strip()
  return env


def _run_process(args, n_devices, timeout, on_line):
  """Run ``python -m bench.runner ARGS``; ``on_line`` gets each stdout line.

  Returns ``(returncode, stderr tail)``; returncode None when killed at ``timeout``.
  """
  cmd = [sys.executable, "-m", "bench.runner"] + args
  with tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                            env=child_env(n_devices))
    try:
      for line in proc.stdout:
        on_line(line)
      rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      rc = None
    err.seek(0)
    return rc, err.read()[-3000:]


def probe(dtypes, n_devices, timeout) -> dict:
  found = {}

  def on_line(line):
    if line.startswith(PROBE_PREFIX):
      found.update(json.loads(line[len(PROBE_PREFIX):]))

  rc, err = _run_process(["--probe", "--dtypes", ",".join(dtypes)], n_devices, timeout,
                         on_line)
  if not found:
    raise SystemExit(f"device probe failed (exit {rc}):\n{err}")
  return found


def device_slug(facts: dict, suite: str = "") -> str:
  """``cpu``, ``nvidia-h100-x1``, ``nvidia-h200-x2``: device kind (two words) + count; a
  run of one suite with a results file of its own (``configs.RESULTS_NAMES``) adds its
  name: ``nvidia-h200-x1-shapes``, ``nvidia-h200-x4-shards``."""
  if facts["platform"] == "cpu":
    slug = "cpu"
  else:
    words = re.sub(r"[^a-z0-9]+", " ", facts["device"].lower()).split()
    slug = f"{'-'.join(words[:2]) or facts['platform']}-x{facts['n_devices']}"
  name = configs.RESULTS_NAMES.get(suite)
  return f"{slug}-{name}" if name else slug


def git(*args) -> str:
  try:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ""


def base_row(config: Config) -> dict:
  return dict(impl=config.impl, variant=config.variant, input=config.input, mode=config.mode,
              T=config.T, V=config.V, D=config.D, dtype=config.dtype,
              chunk_size=config.chunk_size, n_devices=config.n_devices or 1, data=config.data,
              entropy=config.entropy, status="error", error=None, peak_extra_bytes=None,
              ms=None, memory_source=None)


def finish_row(config: Config, fields: dict, facts: dict, stamp: dict) -> dict:
  """Add the floor, logits bytes and ratios to the runner's fields."""
  row = base_row(config)
  row.update(fields)
  n = row["n_devices"]
  size = inputs.itemsize(config.dtype)
  row["logits_bytes"] = inputs.logits_bytes(config, n)
  row["floor_ms"] = floors.floor_ms(config, n, facts["hbm_GBps"], facts["matmul_tflops"], size)
  best = None
  if facts.get("machine_floors", {}).get("floors"):
    from bench import machine_floors
    best = machine_floors.floor_ms(config, facts["machine_floors"], size)
  row["floor_source"] = "machine_best" if best else "probe"
  row["floor_ms"] = best or row["floor_ms"]
  row["x_floor"] = row["ms"] / row["floor_ms"] if row["ms"] else None
  row["x_logits"] = (row["peak_extra_bytes"] / row["logits_bytes"]
                     if row["peak_extra_bytes"] is not None else None)
  row.update(stamp)
  return row


def _oom_key(config: Config):
  return configs.row_key(config)[:4] + configs.row_key(config)[5:]


def run_suite(todo, facts, fresh, timeout, stamp, progress, save=None, budget_s=None,
              fresh_torch=None):
  """Run ``todo`` (a list of configs); returns the finished rows in order.

  Args:
    fresh: one process per JAX config (else one process for all of them: CPU).
    fresh_torch: one process per PyTorch config; default: on CPU (whose peak resident
      memory cannot be reset), else one process per peer (its CUDA peak is reset per row).
    save: receives the rows finished so far after each one (a killed run keeps them).
    budget_s: no process starts after this many seconds; the rest are "skipped".
  """
  platform = facts.get("platform", "cpu")
  fresh_torch = platform != "gpu" if fresh_torch is None else fresh_torch
  start = time.monotonic()
  rows = {}
  oom_at = {}  # an OOM at T skips the same config at larger T (memory grows with T)

  def done(config, fields):
    row = finish_row(config, fields, facts, stamp)
    rows[configs.row_key(config)] = row
    if save is not None:
      save(list(rows.values()))
    if row["status"] == "oom":
      oom_at.setdefault(_oom_key(config), config.T)
    extra = "" if row["peak_extra_bytes"] is None else f"{row['peak_extra_bytes'] / 2**30:.3f} GiB"
    ms = "" if row["ms"] is None else f"{row['ms']:.2f} ms"
    progress.write(f"{config.name:22s} {config.input:6s} {config.mode:7s} T={config.T:<7d} "
                   f"n={row['n_devices']} {row['status']:5s} {extra:>12s} {ms:>12s}"
                   + (f"  {row['error'][:100]}" if row["error"] else ""))
    progress.update(1)

  def why_not(config):
    """A row's fields when ``config`` is not to run (``None`` when it is)."""
    reason = skip_reason(config, platform)
    smaller = oom_at.get(_oom_key(config))
    if reason:
      return dict(status="skipped", error=reason, skipped=reason.split(":")[0])
    if config.n_devices > facts["n_devices"]:
      return dict(status="skipped", error=f"needs {config.n_devices} devices, "
                  f"{facts['n_devices']} present", skipped="too few devices")
    if smaller is not None and smaller < config.T:
      return dict(status="oom", error=f"not run: out of memory at T={smaller}")
    if budget_s is not None and time.monotonic() - start > budget_s:
      return dict(status="skipped", error=f"not run: the run's time budget (--budget-s "
                  f"{budget_s:g}) was spent", skipped="time budget")
    return None

  batch = []

  def flush():
    if batch:
      _run_batch(list(batch), timeout, done)
      batch.clear()

  for i, config in enumerate(todo):
    if configs.row_key(config) in rows:
      continue  # ran in an earlier PyTorch batch
    fields = why_not(config)
    if fields:
      done(config, fields)
    elif config.impl in configs.TORCH_IMPLS:
      flush()
      group = [config] if fresh_torch else [
          c for c in todo[i:] if c.impl == config.impl and configs.row_key(c) not in rows
          and (c is config or why_not(c) is None)]
      _run_batch(group, timeout, done)
    elif fresh:
      _run_batch([config], timeout, done)
    else:
      batch.append(config)
  flush()
  return [rows[configs.row_key(c)] for c in todo]


def _run_batch(batch, timeout, done):
  """One runner process for ``batch`` (one config, or several on CPU)."""
  pending = list(batch)

  def on_line(line):
    if line.startswith(ROW_PREFIX) and pending:
      done(pending.pop(0), json.loads(line[len(ROW_PREFIX):]))

  payload = json.dumps([json.loads(c.to_json()) for c in batch])
  n = max(c.n_devices for c in batch)
  rc, err = _run_process(["--json", payload], n, timeout * len(batch), on_line)
  for config in pending:  # the process died before reporting these
    why = "timed out" if rc is None else f"process exited with {rc}"
    status = "oom" if "RESOURCE_EXHAUSTED" in err or "out of memory" in err.lower() else "error"
    done(config, dict(status=status, error=f"{why}: {err.strip()[-1500:]}"))


def run_module(module: str, prefix: str, args=(), timeout=ROW_TIMEOUT_S) -> dict:
  """``python -m MODULE ARGS`` in a fresh process: the JSON of its ``PREFIX`` line, or
  ``{"error": ...}`` (bench.accuracy, bench.machine_floors)."""
  try:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=child_env(1),
                          capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(error=f"python -m {module} timed out after {timeout} s")
  lines = [l for l in proc.stdout.splitlines() if l.startswith(prefix)]
  if not lines:
    return dict(error=f"python -m {module} exited with {proc.returncode}: "
                f"{proc.stderr.strip()[-2000:]}")
  # The child's progress (with its timings, where it prints them) goes with the result.
  return dict(json.loads(lines[-1][len(prefix):]),
              log=[l for l in proc.stderr.splitlines() if l.startswith("[")][-40:])


def versions() -> dict:
  """Installed versions of the packages the rows depend on (``None``: not installed)."""
  out = {}
  for dist in VERSIONS:
    try:
      out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      out[dist] = None
  return out


def skipped_lines(rows) -> list[str]:
  """Each distinct reason a row did not run, whole, once, with the rows it applies to."""
  reasons = {}
  for r in rows:
    if r["status"] == "skipped" and r.get("error"):
      reasons.setdefault(r["error"], []).append(r)
  return [f"skipped {len(rs)} row(s) of {', '.join(sorted({report.name(r) for r in rs}))}: "
          f"{reason}" for reason, rs in reasons.items()]


def main(argv=None):
  start = time.monotonic()
  args = parse_args(argv)
  left = lambda: None if args.budget_s is None else args.budget_s - (time.monotonic() - start)
  if args.repeat_seconds:
    os.environ["BENCH_REPEAT_SECONDS"] = str(args.repeat_seconds)  # read by the runners
  groups = [g for name in args.suite.split(",") for g in configs.SUITES[name]]
  todo = configs.expand(
      groups, impls=_list(args.impl), inputs=_list(args.input),
      modes=_list(args.mode), Ts=_list(args.T, int), V=args.V, D=args.D, dtype=args.dtype,
      chunk_sizes=_list(args.chunk_size, int), repeats=args.repeats)
  if args.list or not todo:
    for c in todo:
      print(c.to_json())
    if not todo:
      print("no configuration matches these options", file=sys.stderr)
    return
  from tqdm import tqdm
  facts = probe(sorted({c.dtype for c in todo}), max(c.n_devices for c in todo), args.timeout)
  fresh = args.fresh or facts["platform"] != "cpu"
  slug = args.device_slug or device_slug(facts, args.suite)
  # A machine that receives a copy of the tree (the GPU lease: no .git, or a stale one)
  # names the commit it was sent from in JAXCE_COMMIT, which wins; the sender makes sure
  # the tree was clean.
  sent_from = os.environ.get("JAXCE_COMMIT", "")
  commit = sent_from or git("rev-parse", "HEAD")
  dirty = (not sent_from and bool(git("status", "--porcelain", "--", "bench", "jaxce",
                                       ":!bench/results"))) or not commit
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  stamp = dict(commit=commit, date=date, suite=args.suite)
  print(f"{facts['device']} × {facts['n_devices']} ({slug}), JAX {facts['jax']}: "
        f"HBM {facts['hbm_GBps']:.1f} GB/s, bf16 {facts['bf16_tflops']:.3g} TFLOP/s; "
        f"{len(todo)} configurations, {'one process each' if fresh else 'batched'}")
  path = os.path.join(args.out, f"{slug}.json")
  previous = report.load(path) if args.merge or args.resume else None
  if args.resume and previous:
    done_ok = {configs.row_key(r) for r in previous["rows"] if r["status"] == "ok"}
    todo = [c for c in todo if configs.row_key(c) not in done_ok]
    print(f"resuming {path}: {len(todo)} configurations left")
  top = dict(device=facts["device"], n_devices=facts["n_devices"], jax=facts["jax"],
             platform=facts["platform"], host=facts["host"], hbm_GBps=facts["hbm_GBps"],
             bf16_tflops=facts["bf16_tflops"], matmul_tflops=facts["matmul_tflops"],
             commit=commit, dirty=dirty, date=date, suite=args.suite, versions=versions())
  for key, flag, module in (("machine_floors", args.machine_floors, "bench.machine_floors"),
                            ("accuracy", args.accuracy, "bench.accuracy")):
    kept = (previous or {}).get(key)
    if args.resume and kept and "error" not in kept:
      top[key] = kept  # measured by the run this one resumes
    elif flag:
      print(f"{key}: python -m {module}", flush=True)
      timeout = max(args.timeout, 480) if left() is None else max(30, min(480, left()))
      top[key] = run_module(module, __import__(module, fromlist=["PREFIX"]).PREFIX,
                            timeout=int(timeout))
    if key in top:
      facts[key] = top[key]

  def results_of(rows):
    results = dict(top, rows=report.sort_rows(rows))
    return report.merge(previous, results) if previous else results

  with tqdm(total=len(todo), desc=args.suite, unit="cfg", file=sys.stderr) as progress:
    rows = run_suite(todo, facts, fresh, args.timeout, stamp, progress,
                     save=lambda rows: report.write(results_of(rows), path),
                     budget_s=left(), fresh_torch=args.fresh or None)
  results = results_of(rows)
  written = report.write(results, path)
  print()
  print(report.table(results["rows"], results.get("accuracy")))
  print()
  for line in skipped_lines(results["rows"]):
    print(line)
  if facts["platform"] == "cpu" and any(
      r["impl"] == "jaxce" and r["input"] == "logits" and r["mode"] == "fwd"
      for r in results["rows"]):
    print(CPU_COPY_NOTE)
  print("wrote " + ", ".join(os.path.relpath(p) for p in written.values()))


if __name__ == "__main__":
  main()
