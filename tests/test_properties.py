"""Property-based tests: random problems on both paths against the float64 reference.

Each example draws T, V, D, dtype (f32, bf16), chunk size, vocab block size, vocab shard
count (1, 2, 4 simulated devices), temperature (default, scalar, per token), masks
(``where``, -100 labels), a padded ``vocab_size`` and a kind of logits (peaked, nearly
flat, shifted by +-300, all negative, a third of the columns -inf), then checks values
and gradients (random per-token cotangents for both outputs) and the invariants.
Sizes come from a few fixed values so that compiled plans are reused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import TOLERANCE, jaxce, reference
from strategies import (BLOCKS, CHUNKS, assert_as_accurate_as_plain_jax, cases,
                        hypothesis_settings, logit_scale, make_inputs, max_error, run)

# Rounding allowed on the invariants: log-prob <= 0 and 0 <= entropy <= log(#columns)
# hold exactly in real arithmetic; in f32 (with XLA's polynomial exp) they may be missed
# by a few ulps of the O(1)..O(log V) quantities involved. A padded-vocab or
# running-max bug misses them by >= 1/V ~ 1e-2 here.
ROUNDING = 1e-5


def _kept(case, inputs):
  """``[T]`` bool: positions that are not ignored."""
  _, rest, _ = inputs
  kept = rest["labels"] >= 0
  return kept & rest["where"] if "where" in rest else kept


def _finite_columns(case, inputs):
  """``[T]`` number of finite logical columns per row (the entropy is at most its log)."""
  diff, _, _ = inputs
  if case.path == "logits":
    finite = np.isfinite(diff["logits"])
  else:
    bias = diff.get("bias", np.zeros(case.columns))
    finite = np.broadcast_to(np.isfinite(bias), (case.tokens, case.columns))
  return finite[:, :case.logical_vocab].sum(axis=1)


def _check_invariants(case, result, inputs):
  (logp, entropy), grads = result
  kept = _kept(case, inputs)
  assert np.all(logp <= ROUNDING), f"positive log-prob {logp.max()}"
  assert np.all(logp[~kept] == 0)
  assert np.isfinite(logp).all()
  if entropy is not None:
    assert np.all(entropy >= -ROUNDING), f"negative entropy {entropy.min()}"
    bound = np.log(_finite_columns(case, inputs)) + ROUNDING
    assert np.all(entropy <= bound), f"entropy above log(#columns): {entropy - bound}"
    assert np.all(entropy[~kept] == 0)
  for name, g in grads.items():
    assert np.isfinite(np.asarray(g, np.float64)).all(), f"d {name} not finite"
  # Ignored rows, padded columns and -inf columns get exactly zero gradient.
  rows = grads["logits"] if case.path == "logits" else grads["hidden"]
  assert np.all(rows[~kept] == 0), "gradient at ignored rows"
  if case.path == "logits":
    assert np.all(grads["logits"][:, case.logical_vocab:] == 0), "gradient in padded columns"
    assert np.all(grads["logits"][np.isinf(inputs[0]["logits"])] == 0), "gradient at -inf"
  else:
    assert np.all(grads["weight"][:, case.logical_vocab:] == 0), "d weight in padded columns"
    if "bias" in grads:
      assert np.all(grads["bias"][case.logical_vocab:] == 0), "d bias in padded columns"


def _check_case(case):
  inputs = make_inputs(case)
  result = run(case, inputs)
  assert_as_accurate_as_plain_jax(case, result, inputs)
  _check_invariants(case, result, inputs)


@hypothesis_settings(20)
@given(cases(path="logits"))
def test_logits_path_matches_reference(case):
  _check_case(case)


@hypothesis_settings(15)
@given(cases(path="linear"))
def test_linear_path_matches_reference(case):
  _check_case(case)


def _rounding_tolerance(case, inputs, expected, is_grad):
  """How far two equally valid plans (chunking, vocab blocks, shards) may disagree: 64
  f32 ulps of the largest ``|logits / T|`` (the statistics are sums of ``exp(z - max)``
  in a different order, and ``lse = max + log(sum)`` is rounded at the max's scale),
  relative to the output's scale; bf16 gradients may also round to the next bf16 value.
  """
  scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
  tol = 64 * np.finfo(np.float32).eps * (1 + logit_scale(case, inputs)) * scale
  if is_grad and case.dtype == "bfloat16":
    tol += 2.0**-7 * scale
  return tol


@hypothesis_settings(12)
@given(cases(), st.data())
def test_chunking_and_sharding_do_not_change_results(case, data):
  inputs = make_inputs(case)
  other = dict(chunk_size=data.draw(st.sampled_from(CHUNKS), "chunk_size"),
               shards=data.draw(st.sampled_from(
                   [k for k in (1, 2, 4) if case.columns % k == 0]), "shards"))
  if case.path == "linear":
    other["vocab_block_size"] = data.draw(st.sampled_from(BLOCKS), "vocab_block_size")
  if other["shards"] > 1:
    other["implementation"] = None  # Pallas is not interpreted inside shard_map
  (out_a, grads_a), (out_b, grads_b) = run(case, inputs), run(case, inputs, **other)
  for name, a, b in [("logp", out_a[0], out_b[0]), ("entropy", out_a[1], out_b[1])] + [
      (f"d {k}", grads_a[k], grads_b[k]) for k in sorted(grads_a)]:
    if a is None:
      assert b is None
      continue
    err, tol = max_error(a, b), _rounding_tolerance(case, inputs, a, name.startswith("d "))
    assert err <= tol, f"{name} changed by {err:.2e} > {tol:.1e} with {other}"


def _two_way_logits(tokens=16, columns=32):
  """f32 ``[T, V]`` logits ~100 with two equal maxima per row, shifted per row so that
  ``max + log(sum)`` rounds differently on every row."""
  x = np.full((tokens, columns), -3.0)
  x[:, :2] = 0.0
  return (x + 100.0 + 0.037 * np.arange(tokens)[:, None]).astype(np.float32)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_gradient_precision_at_large_logits(path):
  """Low temperature (0.1) on logits ~100: z ~ 1000, where one f32 ulp is 6e-5. Plain
  JAX's f32 gradient is within 1e-7 of the float64 one; jaxce must be within tolerance
  of that."""
  x = _two_way_logits()
  labels = jnp.zeros(x.shape[0], jnp.int32)
  if path == "logits":
    arrays, fns = (x,), (jaxce.logprobs_and_entropy, reference.logprobs_and_entropy)
  else:  # logits = hidden @ weight with a per-token shift carried by hidden[:, 1]
    hidden = np.stack([np.ones(x.shape[0]), 0.037 * np.arange(x.shape[0])], 1)
    weight = np.stack([x[0], np.ones(x.shape[1])])
    arrays = (hidden.astype(np.float32), weight.astype(np.float32))
    fns = (jaxce.linear_logprobs_and_entropy, reference.linear_logprobs_and_entropy)

  def grads(fn, dtype):
    loss = lambda *a: sum(jnp.sum(o) for o in fn(*a, labels, temperature=0.1))
    grad = jax.jit(jax.grad(loss, tuple(range(len(arrays)))))
    return grad(*(jnp.asarray(a, dtype) for a in arrays))

  ours, plain, exact = grads(fns[0], jnp.float32), *(grads(fns[1], d) for d in (jnp.float32,
                                                                                 jnp.float64))
  for g, p, e in zip(ours, plain, exact):
    assert max_error(g, e) <= max_error(p, e) + TOLERANCE[jnp.float32]["grad"]
