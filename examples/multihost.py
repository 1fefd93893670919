"""The GRPO step as several processes, each owning part of one data x vocab mesh.

    python -m examples.multihost                    # 2 processes x 4 CPU devices, mesh 4,2
    python -m examples.multihost --num-processes 2 --local-devices 2 -- --mesh 2,2 --vocab 4096

The launcher starts ``--num-processes`` copies of this module on this machine (CPU, with
``--local-devices`` simulated devices each); every copy calls

    jax.distributed.initialize(coordinator_address="localhost:<port>",
                               num_processes=N, process_id=i)

exactly as on a multi-host GPU cluster (where the coordinator is host 0's address and each
process sees its host's GPUs), builds the same host data (:func:`examples.grpo.
synthetic_problem`), places only its own shards (``jax.make_array_from_callback``) and runs
:func:`examples.train.train_on_rollouts` on the global mesh, once per ``--layouts``:

* ``data_across``: each process holds whole ``vocab`` groups; gradients are reduced across
  processes, jaxce's collectives stay inside one (the usual layout: tensor parallel on the
  fast links);
* ``crossed``: every ``data`` group and every ``vocab`` group spans the processes, so both
  the gradient reduction and jaxce's ``pmax`` / ``psum`` over the vocabulary cross them.

Process 0 prints the metrics and, with ``--out``, saves the final parameters and metrics to
an ``.npz``. Everything is bounded in time: the launcher kills the processes after
``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

LAYOUTS = ("data_across", "crossed")


def parse_args(argv=None):
  """Launcher and worker flags; the example's own flags follow `--`."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--num-processes", type=int, default=2)
  p.add_argument("--local-devices", type=int, default=4, help="CPU devices per process")
  p.add_argument("--timeout", type=float, default=120.0, help="seconds, then kill them all")
  p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of "
                 f"{LAYOUTS}")
  p.add_argument("--out", default=None, help=".npz for params and metrics (process 0)")
  p.add_argument("--process-id", type=int, default=None, help="(worker) this process")
  p.add_argument("--coordinator", default=None, help="(worker) host:port of process 0")
  p.add_argument("problem", nargs="*", help="flags of examples.grpo, after --")
  return p.parse_args(argv)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def on_a_free_port(run, attempts=3):
  """``run(coordinator)`` with ``coordinator`` a free ``localhost:port``; again on another
  port when a process took that one between ``free_port`` and the coordinator's bind
  (``run``'s ``RuntimeError`` carries the workers' output, "Address already in use"):
  beside a test suite's other workers a free port does not stay free."""
  for attempt in range(attempts):
    try:
      return run(f"localhost:{free_port()}")
    except RuntimeError as error:
      if "Address already in use" not in str(error) or attempt == attempts - 1:
        raise


def layout_devices(layout: str, data: int, vocab: int):
  """The global devices in mesh order (row-major ``[data, vocab]``) for ``layout``."""
  import jax
  if layout == "data_across":
    return jax.devices()  # process 0's devices first: whole mesh rows per process
  if layout != "crossed":
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  # Mesh cell (i, j) goes to process (i + j) mod P: a Latin square, so every row (vocab
  # group) and every column (data group) holds devices of different processes.
  local = [iter(jax.local_devices(process_index=p)) for p in range(jax.process_count())]
  try:
    return [next(local[(i + j) % len(local)]) for i in range(data) for j in range(vocab)]
  except StopIteration:
    raise ValueError(f"a crossed {data} x {vocab} mesh needs the process count to divide "
                     "data or vocab") from None


def worker(args):
  """One process: join the cluster, train on the global mesh, report from process 0."""
  import jax
  jax.config.update("jax_num_cpu_devices", args.local_devices)
  try:  # cross-process collectives on CPU (the default in recent JAX)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except AttributeError:  # a JAX without the option
    pass
  jax.distributed.initialize(coordinator_address=args.coordinator,
                             num_processes=args.num_processes, process_id=args.process_id)
  from examples import grpo
  from examples.train import make_mesh, train_on_rollouts

  problem = grpo.parse_args(args.problem)
  data, vocab = grpo.mesh_shape(problem) or (jax.device_count() // 2, 2)
  _, cfg, optimizer = grpo.configs(problem)
  graphdef, params, ref_params, rollouts = grpo.synthetic_problem(problem)
  results = {}
  for layout in args.layouts.split(","):
    mesh = make_mesh(data, vocab, layout_devices(layout, data, vocab))
    final, history = train_on_rollouts(graphdef, params, ref_params, rollouts, cfg=cfg,
                                       optimizer=optimizer, num_steps=problem.inner_steps,
                                       mesh=mesh)
    for i, leaf in enumerate(jax.tree.leaves(final)):
      results[f"{layout}/param/{i}"] = leaf
    for key in history[0]:
      results[f"{layout}/{key}"] = np.array([h[key] for h in history])
    if jax.process_index() == 0:
      for step, metrics in enumerate(history):
        print(f"{layout} ({data}x{vocab} mesh over {jax.process_count()} processes) step "
              f"{step}  " + "  ".join(f"{k} {v:.6f}" for k, v in metrics.items()), flush=True)
  if jax.process_index() == 0 and args.out:
    np.savez(args.out, **results)
  jax.distributed.shutdown()


def subprocess_env(**overrides):
  """This environment with ``overrides`` and this checkout importable (``-m examples.*``)."""
  env = dict(os.environ, **overrides)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  return env


def worker_env():
  """On CPU, minus any simulated-device flag (each worker sets its own count)."""
  env = subprocess_env(JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  return env


def wait_all(procs, timeout: float) -> str | None:
  """Waits for every process of ``procs``: None when all exit 0 within ``timeout``
  seconds, else why not, every process still running then killed at once (the others
  would wait for it in a collective)."""
  deadline = time.monotonic() + timeout
  failed = None
  while failed is None and any(p.poll() is None for p in procs):
    codes = [p.poll() for p in procs]
    if any(code not in (None, 0) for code in codes):
      failed = f"process {next(i for i, c in enumerate(codes) if c)} exited with an error"
    elif time.monotonic() > deadline:
      failed = f"still running after {timeout:.0f} s"
    time.sleep(0.05)
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.wait()
  if failed is None and any(p.returncode for p in procs):
    failed = "a process exited with an error"
  return failed


def launch(problem=(), *, num_processes=2, local_devices=4, layouts=LAYOUTS, timeout=120.0,
           out=None):
  """Run the workers to completion; returns each one's combined stdout/stderr.

  Raises ``RuntimeError`` (with every worker's output) when a worker fails or the
  ``timeout`` (seconds, for all of them together) runs out; then every worker still
  running is killed at once (the others would wait for it in a collective).
  """
  return on_a_free_port(lambda coordinator: _launch(
      problem, num_processes=num_processes, local_devices=local_devices, layouts=layouts,
      timeout=timeout, out=out, coordinator=coordinator))


def _launch(problem, *, num_processes, local_devices, layouts, timeout, out, coordinator):
  base = [sys.executable, "-m", "examples.multihost", "--num-processes", str(num_processes),
          "--local-devices", str(local_devices), "--layouts", ",".join(layouts),
          "--coordinator", coordinator]
  base += ["--out", out] if out else []
  logs = [tempfile.TemporaryFile("w+") for _ in range(num_processes)]
  procs = [subprocess.Popen(base + ["--process-id", str(i), "--", *problem], env=worker_env(),
                            stdout=log, stderr=subprocess.STDOUT, text=True)
           for i, log in enumerate(logs)]
  failed = wait_all(procs, timeout)
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  if failed:
    raise RuntimeError(failed + "".join(f"\n--- process {i} ---\n{o[-5000:]}"
                                        for i, o in enumerate(outputs)))
  return outputs


def main(argv=None):
  args = parse_args(argv)
  if args.process_id is not None:
    return worker(args)
  outputs = launch(args.problem, num_processes=args.num_processes,
                   local_devices=args.local_devices, layouts=args.layouts.split(","),
                   timeout=args.timeout, out=args.out)
  print("\n".join(line for line in outputs[0].splitlines() if "step" in line))


if __name__ == "__main__":
  main()
