"""Shared test helpers: adversarial inputs, float64 references, tolerances."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from jaxce import reference

# Max abs error allowed against the float64 reference, by input dtype, for outputs
# (log-prob, entropy) and for gradients. f32 inputs are exact up to f32 rounding of
# O(10)-sized logits; bf16/f16 inputs are checked separately against the plain-JAX error.
TOLERANCE = {
    jnp.float64: dict(value=1e-10, grad=1e-10),
    jnp.float32: dict(value=2e-4, grad=2e-5),
}


def adversarial_logits(rng, shape, *, scale=4.0, offset=0.0, peak=25.0, banned=0.0):
  """Peaked, shifted logits: one dominant column per row, a global offset, optional
  -inf (banned) columns. Returned as float64 numpy."""
  x = rng.normal(size=shape) * scale + offset
  rows = np.prod(shape[:-1], dtype=int)
  flat = x.reshape(rows, shape[-1])
  flat[np.arange(rows), rng.integers(0, shape[-1], rows)] += peak
  if banned:
    flat[rng.random(flat.shape) < banned] = -np.inf
  return flat.reshape(shape)


def weighted_loss(fn, *arrays, labels, cot_logp, cot_entropy, **kw):
  """``sum(a * logp) + sum(b * entropy)`` with per-token cotangents a, b."""
  logp, entropy = fn(*arrays, labels, **kw)
  loss = jnp.sum(cot_logp * logp)
  if entropy is not None and cot_entropy is not None:
    loss = loss + jnp.sum(cot_entropy * entropy)
  return loss


def value_and_grads(fn, arrays, argnums, **kw):
  """``(logp, entropy), grads`` of the weighted loss w.r.t. ``arrays[argnums]``: the outputs
  from an eager call, the gradients from one jitted program (eagerly, each op of the
  backward would compile a program of its own: bench/NOTES.md, entry 87)."""
  outputs = fn(*arrays, kw["labels"], **{k: v for k, v in kw.items()
                                          if k not in ("labels", "cot_logp", "cot_entropy")})
  grads = jax.jit(jax.grad(lambda *a: weighted_loss(fn, *a, **kw), argnums))(*arrays)
  return outputs, grads


def kernel_device():
  """The keywords a backend kernel takes about where it runs (``interpret`` off GPUs, the
  Mosaic kernels' SM count), as the planner sets them for this platform."""
  target = jaxce.plan.target()
  return dict(interpret=target.platform != "gpu", num_cores=target.num_cores)


def devices(n):
  """The first ``n`` devices, or a skip naming how many the test needs (on one GPU; CPU
  runs simulate 8)."""
  if len(jax.devices()) < n:
    import pytest  # pylint: disable=import-outside-toplevel
    pytest.skip(f"needs {n} devices, {len(jax.devices())} present")
  return jax.devices()[:n]


def skip_module_without_mosaic_interpreter():
  """Skip the calling test module off GPUs where JAX has no Mosaic GPU interpreter (JAX <
  0.11, which pip resolves on Python 3.11); call it at module level."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != "gpu" and not hasattr(plgpu, "InterpretGPUParams"):
    import pytest  # pylint: disable=import-outside-toplevel
    pytest.skip(f"the Mosaic GPU interpreter needs JAX >= 0.11 (this is {jax.__version__}); "
                ".ci/run runs these tests on Python 3.12", allow_module_level=True)


def reference_options(fn, options):
  """The keyword options of a public call that ``fn`` (a reference function) takes: the
  references take only the options that change the numbers, nothing about chunking,
  sharding or implementation."""
  taken = inspect.signature(fn).parameters
  return {k: v for k, v in options.items() if k in taken}


def assert_close(actual, expected, atol, what):
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  assert not np.isnan(actual).any(), f"{what}: NaN in result"
  err = np.max(np.abs(actual - expected)) if actual.size else 0.0
  assert err <= atol, f"{what}: max abs error {err:.3e} > {atol:.1e}"


def count_primitives(jaxpr, *names: str) -> int:
  """How many equations of the primitives ``names`` ``jaxpr`` (a jaxpr or closed jaxpr)
  holds, those of the jaxprs in its equations' parameters included (each counted once)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name in names
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          total += count_primitives(inner, *names)
  return total


__all__ = ["TOLERANCE", "adversarial_logits", "assert_close", "count_primitives", "devices",
           "jaxce", "kernel_device", "reference", "reference_options",
           "skip_module_without_mosaic_interpreter", "value_and_grads", "weighted_loss"]
