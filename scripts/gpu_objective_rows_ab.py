"""The fused objective path with its rows from the fused head's forward kernel (the plan's
default on Hopper) against its rows from XLA's matmul and the statistics' own pass (the
plan before), in one process: time and bits.

``linear_token_loss`` with GRPO's objective under ``jit(value_and_grad)``, V = 151936,
bf16, at D = 1024 and 4096 and ragged and round T. The two alternate in ``ROUNDS`` rounds
(each: ``SETTLE_S`` seconds of untimed calls, then the median of ``REPEATS``), so the
card's clocks under its power limit weigh on both alike. Bits: each token's ``logp`` and
``entropy`` against the scoring pass's (``linear_logprobs_and_entropy``, no gradient, the
same inputs), in the default mode and with ``batch_invariant=True``.

    python -m scripts.gpu_objective_rows_ab   # Hopper GPU: JSON lines, $OUT/objective_rows_ab.json
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench.timing import time_calls
from jaxce import plan as planner

V = 151936
SHAPES = [(1024, 8184), (1024, 8192), (1024, 32760), (4096, 8184), (4096, 8192), (4096, 32768)]
ROUNDS, REPEATS, SETTLE_S = 3, 5, 2.0
if os.environ.get("AB_SMOKE"):  # (a CPU run of the script itself)
  V, SHAPES, ROUNDS, REPEATS, SETTLE_S = 384, [(64, 300)], 1, 1, 0.0
VARIANTS = ("kernel_rows", "xla_rows")


_HEAD_UNSUPPORTED = planner._head_unsupported  # pylint: disable=protected-access


@contextlib.contextmanager
def _planned_as(variant):
  """Calls traced inside plan the objective path's rows as ``variant`` says: ``"xla_rows"``
  as before (XLA's matmul; the fused head's kernels reported unable to run them)."""
  if variant == "xla_rows":
    planner._head_unsupported = lambda *a, **k: (  # pylint: disable=protected-access
        _HEAD_UNSUPPORTED(*a, **k) or "the A/B's other variant")
  try:
    yield
  finally:
    planner._head_unsupported = _HEAD_UNSUPPORTED  # pylint: disable=protected-access


def _problem(depth, tokens, seed=0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.standard_normal((tokens, depth), dtype=np.float32), jnp.bfloat16)
  weight = jnp.asarray(rng.standard_normal((depth, V), dtype=np.float32) * depth**-0.5,
                       jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, V, tokens), jnp.int32)
  mask = jnp.asarray(rng.random(tokens) < 0.9)
  args = (jnp.asarray(rng.standard_normal(tokens), jnp.float32),  # advantages
          jnp.asarray(-rng.uniform(0.1, 8.0, tokens), jnp.float32),  # old log-probs
          jnp.asarray(-rng.uniform(0.1, 8.0, tokens), jnp.float32),  # reference log-probs
          jaxce.objectives.token_weights(mask))
  return hidden, weight, labels, mask, args


def _step(variant, labels, mask, args, **options):
  """The objective path's jitted fwd+grad, traced under ``variant``'s plan."""
  objective = jaxce.objectives.grpo(0.2, 0.28, beta=0.04, entropy_coef=0.01)

  def loss(h, w):
    return jaxce.linear_token_loss(objective, h, w, labels, *args, where=mask, **options)
  step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  return step, loss


def main():
  out_dir = os.environ.get("OUT", "bench/out")
  rows = []

  def emit(**row):
    rows.append(dict(row, at=time.strftime("%H:%M:%S")))
    print(json.dumps(rows[-1]), flush=True)

  emit(kind="run", device=jax.devices()[0].device_kind, jax=jax.__version__,
       commit=os.environ.get("JAXCE_COMMIT", "unknown"))
  for depth, tokens in SHAPES:
    hidden, weight, labels, mask, args = _problem(depth, tokens)
    kept = np.asarray(mask)
    modes = {"default": {}}
    if tokens <= 8192:
      modes["batch_invariant"] = dict(batch_invariant=True)
    scored = {mode: jax.jit(lambda h, w, o=options: jaxce.linear_logprobs_and_entropy(
        h, w, labels, where=mask, **o))(hidden, weight) for mode, options in modes.items()}
    calls = {}
    for variant in VARIANTS:
      with _planned_as(variant):
        for mode, options in modes.items():  # (traced, so planned, inside)
          step, loss = _step(variant, labels, mask, args, **options)
          got = step(hidden, weight)[0][1]
          differ = {name: int(np.sum(np.asarray(g)[kept].view(np.uint32)
                                     != np.asarray(s)[kept].view(np.uint32)))
                    for name, g, s in zip(("logp", "entropy"), got, scored[mode])}
          emit(kind="bits", variant=variant, mode=mode, D=depth, T=tokens,
               tokens_compared=int(kept.sum()), differing=differ,
               max_abs_logp=float(jnp.max(jnp.abs(got[0] - scored[mode][0]))))
          if mode == "default":
            calls[variant] = step
            plan = jaxce.plan.of(loss, hidden, weight)
            emit(kind="plan", variant=variant, D=depth, T=tokens, backend=plan.backend,
                 chunk=plan.chunk, grad_chunk=plan.grad_chunk, kernel_chunk=plan.kernel_chunk,
                 reason=plan.reason)
    medians = {v: [] for v in VARIANTS}
    for round_ in range(ROUNDS):
      for variant in VARIANTS:
        step = calls[variant]
        settle = time.perf_counter()
        while time.perf_counter() - settle < SETTLE_S:
          jax.block_until_ready(step(hidden, weight))
        times = time_calls(step, (hidden, weight), REPEATS, 0)
        medians[variant].append(statistics.median(times))
        emit(kind="time", variant=variant, D=depth, T=tokens, round=round_, ms=times)
    emit(kind="summary", D=depth, T=tokens,
         **{f"{v}_ms": statistics.median(m) for v, m in medians.items()},
         ratio=statistics.median(medians["kernel_rows"]) / statistics.median(medians["xla_rows"]))
    del calls
  with open(os.path.join(out_dir, "objective_rows_ab.json"), "w") as f:
    json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
