"""``python -m bench``: run a suite, merge its rows into bench/results/<device>.json.

    python -m bench                                  # the small CPU suite (~2 min)
    python -m bench --suite gpu --input logits       # see bench/README.md for GPU runs
    python -m bench --suite cpu --impl jaxce,jax_plain --T 1024,4096 --mode fwd_bwd

One process probes the device and measures the floors; then every configuration runs in
a fresh process (``python -m bench.runner``), because peak device memory can only be read
per process. On CPU, where the memory figure is XLA's compiled plan, not a peak, the JAX
configurations share one process unless ``--fresh`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

from bench import configs, floors, inputs, report
from bench.configs import Config
from bench.runner import PROBE_PREFIX, ROW_PREFIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
ROW_TIMEOUT_S = 900


def _list(text, cast=str):
  if text is None:
    return None
  return [None if v.strip().lower() == "none" else cast(v.strip()) for v in text.split(",")]


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
  p.add_argument("--suite", default=configs.DEFAULT_SUITE, choices=sorted(configs.SUITES))
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
  p.add_argument("--out", default=RESULTS, help="results directory (default bench/results)")
  p.add_argument("--device-slug", help="results file name (default from the device)")
  p.add_argument("--fresh", action="store_true", help="one process per config on CPU too")
  p.add_argument("--timeout", type=int, default=ROW_TIMEOUT_S, help="seconds per process")
  p.add_argument("--list", action="store_true", help="print the configs and exit")
  return p.parse_args(argv)


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


def device_slug(facts: dict) -> str:
  """``cpu``, ``nvidia-h100-x1``, ``nvidia-h200-x2``: device kind (two words) + count."""
  if facts["platform"] == "cpu":
    return "cpu"
  words = re.sub(r"[^a-z0-9]+", " ", facts["device"].lower()).split()
  return f"{'-'.join(words[:2]) or facts['platform']}-x{facts['n_devices']}"


def git(*args) -> str:
  try:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return ""


def base_row(config: Config) -> dict:
  return dict(impl=config.impl, variant=config.variant, input=config.input, mode=config.mode,
              T=config.T, V=config.V, D=config.D, dtype=config.dtype,
              chunk_size=config.chunk_size, n_devices=config.n_devices or 1,
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
  row["x_floor"] = row["ms"] / row["floor_ms"] if row["ms"] else None
  row["x_logits"] = (row["peak_extra_bytes"] / row["logits_bytes"]
                     if row["peak_extra_bytes"] is not None else None)
  row.update(stamp)
  return row


def _missing(config: Config):
  module = configs.REQUIRES.get(config.impl)
  if module and importlib.util.find_spec(module) is None:
    return (f"not installed: {config.impl} needs the Python package providing '{module}' "
            "(bench/README.md, 'GPU runs': bash bench/get_peers.sh, then pip install "
            "--no-deps bench/.wheels/*.whl)")
  return None


def _oom_key(config: Config):
  return configs.row_key(config)[:4] + configs.row_key(config)[5:]


def run_suite(todo, facts, fresh, timeout, stamp, progress, save=None):
  """Run ``todo`` (a list of configs); returns the finished rows in order. ``save``, if
  given, receives the rows finished so far after each one (a killed run keeps them)."""
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

  batch = []

  def flush():
    if batch:
      _run_batch(list(batch), timeout, done)
      batch.clear()

  for config in todo:
    reason = _missing(config)
    smaller = oom_at.get(_oom_key(config))
    if reason:
      done(config, dict(status="skipped", error=reason, skipped="not installed"))
    elif config.n_devices > facts["n_devices"]:
      done(config, dict(status="skipped", error=f"needs {config.n_devices} devices, "
                        f"{facts['n_devices']} present", skipped="too few devices"))
    elif smaller is not None and smaller < config.T:
      done(config, dict(status="oom", error=f"not run: out of memory at T={smaller}"))
    elif fresh or config.impl in configs.TORCH_IMPLS:
      flush()
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


def main(argv=None):
  args = parse_args(argv)
  if args.repeat_seconds:
    os.environ["BENCH_REPEAT_SECONDS"] = str(args.repeat_seconds)  # read by the runners
  todo = configs.expand(
      configs.SUITES[args.suite], impls=_list(args.impl), inputs=_list(args.input),
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
  slug = args.device_slug or device_slug(facts)
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
  previous = report.load(path)

  def save(rows):
    results = dict(device=facts["device"], n_devices=facts["n_devices"], jax=facts["jax"],
                   platform=facts["platform"], host=facts["host"], hbm_GBps=facts["hbm_GBps"],
                   bf16_tflops=facts["bf16_tflops"], matmul_tflops=facts["matmul_tflops"],
                   commit=commit, dirty=dirty, date=date, rows=rows)
    return report.write(report.merge(previous, results), path)

  with tqdm(total=len(todo), desc=args.suite, unit="cfg", file=sys.stderr) as progress:
    rows = run_suite(todo, facts, fresh, args.timeout, stamp, progress, save=save)
  written = save(rows)
  print()
  print(report.table(report.sort_rows(rows)))
  print()
  print("wrote " + ", ".join(written.values()))


if __name__ == "__main__":
  main()
