"""Property-based tests: random problems on both paths against the float64 reference.

Each example draws T, V, D, dtype (f32, bf16), chunk size, vocab block size, vocab shard
count (1, 2, 4 simulated devices), temperature (default, scalar, per token), masks
(``where``, -100 labels), a padded ``vocab_size`` and a kind of logits (peaked, nearly
flat, shifted by +-300, all negative, a third of the columns -inf), then checks values
and gradients (random per-token cotangents for both outputs) and the invariants.
Sizes come from a few fixed values so that compiled plans are reused.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from strategies import (BLOCKS, CHUNKS, assert_as_accurate_as_plain_jax, cases,
                        hypothesis_settings, make_inputs, run)

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


@hypothesis_settings(20)
@given(cases(path="linear"))
def test_linear_path_matches_reference(case):
  _check_case(case)
