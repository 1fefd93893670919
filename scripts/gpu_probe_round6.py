"""Development probe (GPU), round 6: the forward kernel with exp2 and unmasked whole
blocks (jaxce/_pallas.py) against the previous kernel (commit f0d3d02), checked against
float64 on the GPU, and where the logits forward's time goes outside the kernel.
Prints JSON lines.

    git show f0d3d02:jaxce/_pallas.py > scripts/_pallas_prev.py
    python scripts/gpu_probe_round6.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np

import _pallas_prev
import jaxce
from _timing import bench, emit
from jaxce import _math, _pallas, reference

V = int(os.environ.get("PROBE_V", 151936))  # smaller for a dry run on a CPU
TS = [int(t) for t in os.environ.get("PROBE_T", "8192,32768").split(",")]


def _logits(rng, shape, offset=0.0):
  x = rng.normal(size=shape).astype(np.float32) * 4 + offset
  x[np.arange(shape[0]), rng.integers(0, shape[1], shape[0])] += 25
  return x


def check_statistics():
  """(m, s, q) of both kernels against float64 on bf16 and f32 rows, several ranges."""
  rng = np.random.default_rng(0)
  for dtype, offset, (start, limit) in [
      ("bfloat16", 0.0, (0, V)), ("bfloat16", -300.0, (0, V)),
      ("float32", 0.0, (4099, V - 1935)), ("float32", 30.0, (V // 9, V // 4))]:
    x = jnp.asarray(_logits(rng, (257, V), offset), dtype)
    inv_temp = jnp.asarray(rng.uniform(0.5, 2.0, 257), jnp.float32)
    z = np.asarray(x, np.float64)[:, start:limit] * np.asarray(inv_temp, np.float64)[:, None]
    zmax = z.max(1)
    lse = np.log(np.exp(z - zmax[:, None]).sum(1)) + zmax
    p = np.exp(z - lse[:, None])
    entropy = -(p * np.log(np.where(p > 0, p, 1))).sum(1)
    for name, module in (("new", _pallas), ("prev", _pallas_prev)):
      kw = dict(start=start) if start else {}
      if start and name == "prev" and "start" not in module.row_statistics.__code__.co_varnames:
        continue
      m, s, q = (np.asarray(a, np.float64) for a in module.row_statistics(
          x, inv_temp, limit, True, **kw))
      emit(part="stats_error", kernel=name, dtype=dtype, offset=offset, start=start,
           limit=limit, lse=float(np.abs(m + np.log(s) - lse).max()),
           entropy=float(np.abs(np.log(s) - q / s - entropy).max()))


def check_path():
  """Values and gradients of the logits path (Pallas vs XLA statistics) against float64."""
  rng = np.random.default_rng(1)
  T = 512
  x = jnp.asarray(_logits(rng, (T, V), -50.0), jnp.float32)
  labels = jnp.asarray(rng.integers(0, V, T), jnp.int32)
  a, b = (jnp.asarray(rng.normal(size=T), jnp.float32) for _ in range(2))

  def loss(f, x):
    logp, ent = f(x, labels)
    return jnp.sum(a * logp) + jnp.sum(b * ent), (logp, ent)

  (_, (lp_ref, en_ref)), g_ref = jax.value_and_grad(
      lambda x: loss(reference.logprobs_and_entropy, x), has_aux=True)(
          jnp.asarray(x, jnp.float64) if jax.config.jax_enable_x64 else x)
  for impl in ("pallas", "xla"):
    f = lambda x, l: jaxce.logprobs_and_entropy(x, l, implementation=impl)
    (_, (lp, en)), g = jax.jit(jax.value_and_grad(lambda x: loss(f, x), has_aux=True))(x)
    emit(part="path_error", impl=impl, x64=bool(jax.config.jax_enable_x64),
         logp=float(jnp.abs(lp - lp_ref).max()), entropy=float(jnp.abs(en - en_ref).max()),
         grad=float(jnp.abs(g - g_ref).max()))


def timings(T):
  rng = np.random.default_rng(2)
  x = jnp.tile(jnp.asarray(_logits(rng, (1024, V)), jnp.bfloat16), (T // 1024, 1))
  labels = jnp.asarray(rng.integers(0, V, T), jnp.int32)
  inv_temp = jnp.ones((T,), jnp.float32)
  adv = jnp.asarray(rng.normal(size=T), jnp.float32)
  out = {}
  for name, module in (("new", _pallas), ("prev", _pallas_prev)):
    for entropy in (True, False):
      f = jax.jit(lambda x, t, m=module, e=entropy: m.row_statistics(x, t, V, e))
      out[f"stats_{name}{'' if entropy else '_logp_only'}"] = bench(f, x, inv_temp)
  out["label_gather"] = bench(jax.jit(lambda x, l, t: _math.label_logit(x, l, t, 0)),
                              x, labels, inv_temp)
  out["row_max_xla"] = bench(jax.jit(lambda x: jnp.max(x, axis=1)), x)
  for impl in ("pallas", "xla"):
    fwd = jax.jit(lambda x, l, i=impl: jaxce.logprobs_and_entropy(x, l, implementation=i))
    out[f"fwd_{impl}"] = bench(fwd, x, labels)

    def objective(x, i=impl):
      lp, en = jaxce.logprobs_and_entropy(x, labels, implementation=i)
      return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
    out[f"fwd_bwd_{impl}"] = bench(jax.jit(jax.value_and_grad(objective)), x)
  emit(part="ms", T=T, **{k: round(v, 3) for k, v in out.items()})


if __name__ == "__main__":
  emit(part="device", device=str(jax.devices()[0]), jax=jax.__version__)
  check_statistics()
  check_path()
  for T in TS:
    timings(T)
  jax.config.update("jax_enable_x64", True)
  check_path()
