"""Helpers for ``memory_vs_chunk_size.ipynb``: the cases it compiles, their XLA memory
plans, their timings, and a peak-memory measurement in a fresh process.

A *case* is a JSON-serialisable dict, so a child process can rebuild it::

    path:   "logits" (jaxce.logprobs_and_entropy) or "fused" (linear_logprobs_and_entropy)
    impl:   "jaxce" or "plain" (jaxce.reference.*: jax.nn.log_softmax and autodiff)
    mode:   "fwd" ((logp, entropy)) or "fwd+bwd" (the gradient of the RL loss below)
    T, V:   tokens and vocabulary; D (fused path only): hidden size
    dtype:  input dtype name ("bfloat16", "float32")
    chunk:  chunk_size passed to jaxce (int, or None for the planned default)
    shards: vocab shards (optional; logits path: jaxce.sharded_logprobs_and_entropy)

The loss is ``sum(adv * logp) + 0.01 * sum(entropy)`` with per-token ``adv``; its
gradient is taken w.r.t. the logits (logits path) or ``(hidden, weight)`` (fused path).

Run as a script (``python memory_helpers.py '<case json>'``) it measures one case's
device peak in its own process and prints one JSON line (see :func:`measure_peak`).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = NOTEBOOK_DIR.parent

try:
  import jaxce
except ImportError:  # running from a checkout that is not pip-installed
  sys.path.insert(0, str(REPO_ROOT))
  import jaxce

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxce import reference

try:
  from bench.timing import time_ms
except ImportError:  # the notebook's kernel runs in notebooks/: bench sits in the checkout
  sys.path.append(str(REPO_ROOT))
  from bench.timing import time_ms

ENTROPY_WEIGHT = 0.01


def _entry(case):
  """The per-token function of a case, with the chunking options bound."""
  path, impl = case["path"], case["impl"]
  module = jaxce if impl == "jaxce" else reference
  options = {"chunk_size": case.get("chunk")} if impl == "jaxce" else {}
  if impl == "jaxce" and path == "logits" and case.get("chunk") is not None:
    options["implementation"] = "xla"  # the Pallas forward (GPU default) has no chunks
  fn = module.logprobs_and_entropy if path == "logits" else module.linear_logprobs_and_entropy
  return functools.partial(fn, **options)


def _sharded_entry(case, mesh):
  if case["path"] != "logits" or case["impl"] != "jaxce":
    raise ValueError(f"sharded cases: jaxce logits path only, got {case=}")
  options = {} if case.get("chunk") is None else dict(implementation="xla")
  return functools.partial(jaxce.sharded_logprobs_and_entropy, mesh=mesh, vocab_axis="vocab",
                           chunk_size=case.get("chunk"), **options)


def case_function(case, mesh=None):
  """``f(*inputs, labels, adv)`` -> ``(logp, entropy)`` or the tuple of input gradients.

  With ``mesh`` (and ``case["impl"] == "plain"``) the plain function is left to XLA's
  SPMD partitioner; with ``case["impl"] == "jaxce"`` the shard_map wrapper is used.
  """
  if mesh is not None and case["impl"] == "jaxce":
    fn = _sharded_entry(case, mesh)
  else:
    fn = _entry(case)

  def forward(*arrays):
    *inputs, labels, _ = arrays
    return fn(*inputs, labels)

  if case["mode"] == "fwd":
    return forward

  def loss(*arrays):
    logp, entropy = forward(*arrays)
    return jnp.sum(arrays[-1] * logp) + ENTROPY_WEIGHT * jnp.sum(entropy)

  return jax.grad(loss, argnums=tuple(range(len(input_shapes(case)))))


def input_shapes(case):
  """Shapes and dtypes of the differentiable inputs: ``[(shape, dtype), ...]``."""
  dtype = jnp.dtype(case["dtype"])
  if case["path"] == "logits":
    return [((case["T"], case["V"]), dtype)]
  return [((case["T"], case["D"]), dtype), ((case["D"], case["V"]), dtype)]


def case_specs(case, mesh=None):
  """``jax.ShapeDtypeStruct`` of every argument; vocab-split over ``mesh`` if given."""
  shapes = input_shapes(case) + [((case["T"],), jnp.int32), ((case["T"],), jnp.float32)]
  if mesh is None:
    return [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  split = NamedSharding(mesh, P(None, "vocab"))
  replicated = NamedSharding(mesh, P())
  return [jax.ShapeDtypeStruct(s, d, sharding=split if len(s) == 2 else replicated)
          for s, d in shapes]


def vocab_mesh(devices):
  """A 1-D mesh with axis ``"vocab"`` over ``devices``."""
  return Mesh(np.array(devices), ("vocab",))


def compile_case(case, mesh=None):
  """``jax.jit(f).lower(specs).compile()``: nothing is allocated, nothing runs."""
  return jax.jit(case_function(case, mesh)).lower(*case_specs(case, mesh)).compile()


def memory_plan(compiled) -> dict:
  """XLA's per-device plan in bytes: temp, output, argument, alias and
  ``extra = temp + output - alias`` (what a call adds on top of its live inputs)."""
  m = compiled.memory_analysis()
  plan = dict(temp=m.temp_size_in_bytes, output=m.output_size_in_bytes,
              argument=m.argument_size_in_bytes, alias=m.alias_size_in_bytes)
  plan["extra"] = plan["temp"] + plan["output"] - plan["alias"]
  return plan


def host_inputs(case, seed=0, block_rows=256):
  """Numpy inputs for a case. The 2-D inputs repeat a random ``[block_rows, ...]`` block:
  memory and time do not depend on the values, and a [32768, 151936] array is made in a
  second or two instead of a minute."""
  rng = np.random.default_rng(seed)
  # logits ~ N(0, 4); fused: hidden ~ N(0, 1) and weight ~ N(0, 1/D), so logits ~ N(0, 1).
  scales = [2.0] if case["path"] == "logits" else [1.0, 1.0 / np.sqrt(case["D"])]
  arrays = []
  for ((rows, cols), dtype), scale in zip(input_shapes(case), scales):
    block = rng.standard_normal((min(rows, block_rows), cols), np.float32) * scale
    arrays.append(np.resize(block.astype(dtype), (rows, cols)))
  arrays.append(rng.integers(0, case["V"], case["T"]).astype(np.int32))
  arrays.append(rng.standard_normal(case["T"], np.float32))
  return arrays


def run_time(compiled, device_arrays, reps) -> float:
  """Median seconds per call (after one warm-up call); each call's outputs are dropped
  before the next, so two results are never alive at once (``bench.timing``)."""
  return time_ms(compiled, device_arrays, reps, warmup=1) / 1e3


def memory_stats(device):
  """``device.memory_stats()`` or ``{}`` where the backend has none (CPU)."""
  try:
    return device.memory_stats() or {}
  except Exception:  # noqa: BLE001 -- some backends raise instead of returning None
    return {}


def measure_peak(case, timeout=300) -> dict:
  """Measure one case in a fresh Python process (the device peak never goes down).

  Returns the child's JSON dict: ``plan`` (the compiled plan, in the child),
  ``in_use`` (bytes in use with the inputs on the device, before the call),
  ``peak_compile`` (peak after compiling), ``peak`` (peak after the call),
  ``measured_extra = peak - in_use`` and ``compile_dominates`` (True when compiling
  peaked higher than the call, so ``measured_extra`` is only an upper bound).
  Peaks are ``None`` where the backend reports no memory stats (CPU). On failure (the
  plan does not fit the device, or the child crashed) the dict holds ``error`` instead.
  """
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
  proc = subprocess.run([sys.executable, str(pathlib.Path(__file__)), json.dumps(case)],
                        capture_output=True, text=True, timeout=timeout, env=env)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode != 0 or not lines:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(case=case, error=" | ".join(tail) or f"exit code {proc.returncode}")
  return json.loads(lines[-1])


def _child(case) -> dict:
  device = jax.devices()[0]
  arrays = [jax.device_put(a, device) for a in host_inputs(case)]
  jax.block_until_ready(arrays)
  compiled = compile_case(case)
  plan = memory_plan(compiled)
  stats = memory_stats(device)
  peak_compile, in_use = stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")
  limit = stats.get("bytes_limit")
  if limit and in_use + plan["extra"] > 0.95 * limit:
    return dict(case=case, plan=plan, error=f"does not fit: the plan needs "
                f"{(in_use + plan['extra']) / 2**30:.1f} GiB of {limit / 2**30:.1f} GiB")
  out = compiled(*arrays)
  jax.block_until_ready(out)
  peak = memory_stats(device).get("peak_bytes_in_use")
  del out
  return dict(case=case, device=device.device_kind, plan=plan, in_use=in_use,
              peak_compile=peak_compile, peak=peak,
              measured_extra=None if peak is None else peak - in_use,
              compile_dominates=None if peak is None else peak <= peak_compile)


if __name__ == "__main__":
  print(json.dumps(_child(json.loads(sys.argv[1]))))
