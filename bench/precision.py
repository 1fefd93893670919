"""float32 operands at JAX's default matmul precision and at ``"highest"``: the error vs
float64 of the fused paths (per-token and objective) and of plain JAX
(``jax.nn.log_softmax(hidden @ weight)``), as ``bench.accuracy`` defines it.

The bf16 problem of ``bench.accuracy`` (T = 512, V = 151936, D = 4096: logits about N(0, 4),
64 peaked columns) held in float32 (the same values), the loss ``sum(adv * logp) + 0.01 *
sum(H)``. No global precision setting: ``None`` is what a user gets (on GPUs TF32).

    python -m bench.precision   # JSON lines, $OUT/precision.json (or bench/out)

``table`` makes the benchmarks page's table of a committed run (a test checks it).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench import accuracy

COEF = 0.01


def _paths(labels, adv, precision):
  def per_token(h, w):
    logp, entropy = jaxce.linear_logprobs_and_entropy(h, w, labels, precision=precision)
    return jnp.sum(adv * logp) + COEF * jnp.sum(entropy), (logp, entropy)

  def objective(h, w):
    loss, (logp, entropy) = jaxce.linear_token_loss(
        lambda lp, e, a: a * lp + COEF * e, h, w, labels, adv, precision=precision)
    return loss, (logp, entropy)

  def plain(h, w):
    logp_all = jax.nn.log_softmax(jnp.dot(h, w, precision=precision), axis=-1)
    logp = jnp.take_along_axis(logp_all, labels[:, None], axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return jnp.sum(adv * logp) + COEF * jnp.sum(entropy), (logp, entropy)
  return dict(linear_logprobs_and_entropy=per_token, linear_token_loss=objective,
              jax_plain=plain)


def main():
  t, v, d = (int(os.environ.get(k, default)) for k, default in
             (("T", accuracy.T), ("V", accuracy.V), ("D", accuracy.D)))
  problem = accuracy.host_problem(t, v, d)
  ref = accuracy.reference(problem, COEF)
  h, w = (jnp.asarray(problem[k].astype(np.float32)) for k in ("hidden", "weight"))
  labels, adv = jnp.asarray(problem["labels"]), jnp.asarray(problem["adv"])
  rows = [dict(kind="run", device=jax.devices()[0].device_kind, jax=jax.__version__,
               commit=os.environ.get("JAXCE_COMMIT", "unknown"), T=t, V=v, D=d,
               dtype="float32", jax_default_matmul_precision=str(
                   jax.config.jax_default_matmul_precision))]
  print(json.dumps(rows[0]), flush=True)
  for precision in (None, "highest"):
    for name, loss in _paths(labels, adv, precision).items():
      (_, (logp, entropy)), (d_h, d_w) = jax.jit(jax.value_and_grad(loss, (0, 1),
                                                                     has_aux=True))(h, w)
      got = dict(logp=np.asarray(logp), entropy=np.asarray(entropy),
                 d_hidden=np.asarray(d_h), d_W=np.asarray(d_w))
      planned = (jaxce.plan.of(loss, h, w).precision if name != "jax_plain" else
                 precision or "default")
      rows.append(dict(kind="errors", path=name, precision_argument=precision,
                       plan_precision=planned, **accuracy.errors(got, ref)))
      print(json.dumps(rows[-1]), flush=True)
  with open(os.path.join(os.environ.get("OUT", "bench/out"), "precision.json"), "w") as f:
    json.dump(rows, f, indent=1)


def table(rows) -> str:
  """The markdown table of a run's rows (``precision.json``), as docs/benchmarks.md shows
  it."""
  run = rows[0]
  lines = [f"| path | `precision=` | runs at | logp | entropy | d hidden | d W |",
           "|---|---|---|---|---|---|---|"]
  for row in rows[1:]:
    argument = "None" if row["precision_argument"] is None else f'"{row["precision_argument"]}"'
    lines.append(f"| {row['path']} | {argument} | {row['plan_precision']} | "
                 + " | ".join(f"{row[k]:.1e}" for k in ("logp", "entropy", "d_hidden", "d_W"))
                 + " |")
  return (f"float32 operands, one {run['device']}, JAX {run['jax']}, T = {run['T']}, "
          f"V = {run['V']}, D = {run['D']}:\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
