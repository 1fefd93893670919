"""One process per device against one process over all of them: the sharded fused head's
log-probs and entropies (bits) and its forward + backward time.

    python -m scripts.gpu_check_multiprocess            # a GPU host: one process per GPU
    python -m scripts.gpu_check_multiprocess --tiny     # anywhere: 2 CPU processes (gloo)

The launcher runs, on the same global inputs (made from one seed in every process, each
placing only its own shards, ``jax.make_array_from_callback``) with the vocabulary split
over a ``1 x n`` mesh of the ``n`` devices:

1. one process over all ``n`` devices;
2. ``n`` processes of one device each, joined by ``jax.distributed.initialize`` (the
   coordinator on this host; on GPUs each process's ``local_device_ids`` its own GPU), as
   on a multi-host cluster.

Each runs ``jaxce.sharded_linear_logprobs_and_entropy`` forward (process 0 keeps the
log-probs and entropies) and times ``jax.value_and_grad`` of a weighted sum of both
(median of ``--repeats`` calls after a warm-up). Prints both and the ratio of the times;
exits 1 when a log-prob or entropy bit differs on the kernel paths (``jaxce.plan.of``'s
backend ``mosaic``: every shard's tile statistics merged in rank order, the same program
in one process or many), or when the values differ by more than 1e-5 elsewhere (XLA's
``psum`` may add the shards in another order across processes). Writes the JSON to
``$OUT/multiprocess.json`` (or ``bench/out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.__main__ import git
from examples import multihost

SHAPES = dict(full=(8192, 4096, 151936), tiny=(64, 32, 256))  # T, D, V


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m scripts.gpu_check_multiprocess",
                              description=__doc__.splitlines()[0])
  p.add_argument("--tiny", action="store_true", help="small shapes on 2 CPU processes")
  p.add_argument("--devices", type=int, default=0, help="n (0: every GPU; 2 with --tiny)")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--timeout", type=float, default=300.0, help="seconds for each run")
  p.add_argument("--worker", choices=("one", "many"), help=argparse.SUPPRESS)
  p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # (a worker's .npz)
  return p.parse_args(argv)


def inputs(shape):
  """Host ``(hidden, weight, labels, cotangents)`` of ``shape``: the same in every process."""
  import ml_dtypes
  tokens, dim, vocab = shape
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(tokens, dim)).astype(ml_dtypes.bfloat16)
  weight = (rng.normal(size=(dim, vocab)) * 1.5 / np.sqrt(dim)).astype(ml_dtypes.bfloat16)
  labels = rng.integers(0, vocab, tokens).astype(np.int32)
  cot = rng.normal(size=(2, tokens)).astype(np.float32)
  return hidden, weight, labels, cot


def worker(args):
  """One run (``one``: this process over every device; ``many``: process ``process_id`` of
  ``n``, one device each): the outputs and the median time into ``args.out`` (process 0)."""
  import jax
  tiny = args.tiny
  if args.worker == "many":
    if tiny:
      jax.config.update("jax_num_cpu_devices", 1)
      try:  # cross-process collectives on CPU (the default in recent JAX)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
      except AttributeError:
        pass
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.devices, process_id=args.process_id,
                               **({} if tiny else dict(local_device_ids=[args.process_id])))
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import jaxce
  mesh = Mesh(np.array(jax.devices()[:args.devices]), ("v",))
  hidden, weight, labels, cot = inputs(SHAPES["tiny" if tiny else "full"])
  place = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                                       lambda index: a[index])
  h, w = place(hidden, P()), place(weight, P(None, "v"))
  lab, c = place(labels, P()), place(cot, P())
  call = lambda h, w: jaxce.sharded_linear_logprobs_and_entropy(h, w, lab, mesh=mesh,
                                                                vocab_axis="v")
  plan = jaxce.plan.of(call, h, w)
  logp, entropy = jax.jit(call)(h, w)
  loss = lambda h, w: sum(jnp.sum(ci * o) for ci, o in zip(c, call(h, w)))
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  jax.block_until_ready(step(h, w))
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(h, w))
    times.append(1e3 * (time.perf_counter() - start))
  if jax.process_index() == 0:
    local = lambda a: np.asarray(a.addressable_data(0))
    np.savez(args.out, logp=local(logp), entropy=local(entropy), ms=np.median(times),
             backend=plan.backend, device=jax.devices()[0].device_kind,
             processes=jax.process_count())
  if args.worker == "many":
    jax.distributed.shutdown()


def env_for(args, kind):
  """A worker's environment (``multihost.subprocess_env``: this checkout importable),
  NVLink multicast off; on CPU (``multihost.worker_env``: no simulated-device flag) the
  ``n`` devices of a one-process run, or none (each worker of many sets one)."""
  env = (multihost.worker_env() if args.tiny else multihost.subprocess_env())
  env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0")
  if args.tiny and kind == "one":
    env["XLA_FLAGS"] = (f"{env['XLA_FLAGS']} "
                        f"--xla_force_host_platform_device_count={args.devices}").strip()
  return env


def run(args, kind, out):
  """The workers of one run to completion; RuntimeError with their output when one fails
  or the run passes ``--timeout`` (every worker still running is then killed)."""
  if kind == "many":
    return multihost.on_a_free_port(lambda coordinator: _run(args, kind, out, coordinator))
  return _run(args, kind, out, None)


def _run(args, kind, out, coordinator):
  base = [sys.executable, "-m", "scripts.gpu_check_multiprocess", "--worker", kind,
          "--devices", str(args.devices), "--repeats", str(args.repeats), "--out", out]
  base += ["--tiny"] if args.tiny else []
  if coordinator:
    base += ["--coordinator", coordinator]
  ids = range(args.devices) if kind == "many" else [0]
  logs = [tempfile.TemporaryFile("w+") for _ in ids]
  procs = [subprocess.Popen(base + ["--process-id", str(i)], env=env_for(args, kind),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
           for i, log in zip(ids, logs)]
  failed = multihost.wait_all(procs, args.timeout)
  if failed:
    text = ""
    for i, log in enumerate(logs):
      log.seek(0)
      text += f"\n--- {kind} process {i} ---\n{log.read()[-4000:]}"
    raise RuntimeError(f"{kind}: {failed}{text}")
  with np.load(out) as f:
    return {k: f[k] for k in f.files}


def main(argv=None):
  args = parse_args(argv)
  if args.worker:
    return worker(args)
  if not args.devices:
    args.devices = 2 if args.tiny else int(subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout.count("GPU "))
  with tempfile.TemporaryDirectory() as tmp:
    one = run(args, "one", os.path.join(tmp, "one.npz"))
    many = run(args, "many", os.path.join(tmp, "many.npz"))
  kernels = str(one["backend"]) == "mosaic"
  differ = {k: int(np.sum(one[k].view(np.uint32) != many[k].view(np.uint32)))
            for k in ("logp", "entropy")}
  error = max(float(np.max(np.abs(one[k] - many[k]))) for k in ("logp", "entropy"))
  ok = (not any(differ.values())) if kernels else error <= 1e-5
  report = dict(device=str(one["device"]), devices=args.devices, shape=SHAPES[
      "tiny" if args.tiny else "full"], backend=str(one["backend"]),
      one_process_ms=float(one["ms"]), processes_ms=float(many["ms"]),
      ratio=float(many["ms"] / one["ms"]), bits_differ=differ, max_abs_error=error,
      processes=int(many["processes"]), ok=ok,
      commit=os.environ.get("JAXCE_COMMIT") or git("rev-parse", "HEAD") or "unknown")
  out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "bench", "out")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "multiprocess.json"), "w") as f:
    json.dump(report, f, indent=1)
  print(json.dumps(report))
  print(f"{args.devices} x {report['device']} ({report['backend']}): one process "
        f"{report['one_process_ms']:.2f} ms, {report['processes']} processes "
        f"{report['processes_ms']:.2f} ms ({report['ratio']:.3f}x); bits differ: {differ}; "
        f"{'ok' if ok else 'FAILED'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
