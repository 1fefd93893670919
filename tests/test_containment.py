"""Containment: a bad value in one token touches only that token; masked and empty inputs.

Every call runs inside ``jit(value_and_grad(...))`` (and some eagerly too) with random
per-token cotangents for both outputs. T = 10 with chunk_size = 4 clamps the last chunk
to rows 6..9, so rows 6 and 7 are computed twice: bad values are put there as well.
"""

import numpy as np
import pytest

from strategies import run_jaxce as _run
from strategies import simple_inputs

T, V, D, CHUNK = 10, 24, 8, 4


def _inputs(path, shape=(T,)):
  return simple_inputs(path, shape, columns=V, hidden=D)


def _token_grad(path, grads):
  """The gradient with one row per token: d logits or d hidden."""
  return grads["logits" if path == "logits" else "hidden"]


def _assert_rows_equal(path, result, clean, rows):
  """Outputs and per-token gradient rows ``rows`` are bitwise those of ``clean``."""
  (logp, entropy), grads = result
  (logp0, entropy0), grads0 = clean
  np.testing.assert_array_equal(logp[rows], logp0[rows], "logp of other tokens changed")
  np.testing.assert_array_equal(entropy[rows], entropy0[rows], "entropy of other tokens")
  np.testing.assert_array_equal(_token_grad(path, grads)[rows],
                                _token_grad(path, grads0)[rows], "gradient of other tokens")


def _poison(path, inputs, row, value, column=3):
  """A copy of ``inputs`` with ``value`` in one token's logits (or hidden state)."""
  diff, rest, cot = inputs
  diff = {k: v.copy() for k, v in diff.items()}
  if path == "logits":
    column = (rest["labels"][row] + 1) % V  # not the label's column
    diff["logits"][row, column] = value
  else:
    diff["hidden"][row, column] = value
  return diff, rest, cot


@pytest.mark.parametrize("path,shards,options", [
    ("logits", 1, {}), ("logits", 1, dict(implementation="triton")), ("logits", 2, {}),
    ("linear", 1, {}), ("linear", 1, dict(implementation="triton")), ("linear", 2, {})],
    ids=["logits", "triton", "logits-2", "linear", "linear-triton", "linear-2"])
def test_bad_value_stays_in_its_token(path, shards, options):
  inputs = _inputs(path)
  clean = _run(path, inputs, shards=shards, chunk_size=CHUNK, **options)
  for value in (np.nan, np.inf, -np.inf):
    for row in (0, 6, 7, 9):
      result = _run(path, _poison(path, inputs, row, value), shards=shards, chunk_size=CHUNK,
                    **options)
      others = np.arange(T) != row
      _assert_rows_equal(path, result, clean, others)
      (logp, entropy), _ = result
      if path == "logits" and value == -np.inf:  # a banned column: still a valid row
        assert np.isfinite(logp[row]) and np.isfinite(entropy[row])
      else:  # never a finite wrong number
        assert not np.isfinite(logp[row]), (value, row, logp[row])


def test_bad_value_stays_in_its_token_eagerly():
  inputs = _inputs("logits")
  clean = _run("logits", inputs, jit=False, chunk_size=CHUNK)
  result = _run("logits", _poison("logits", inputs, 7, np.nan), jit=False, chunk_size=CHUNK)
  _assert_rows_equal("logits", result, clean, np.arange(T) != 7)
  assert np.isnan(result[0][0][7])


@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("mask", ["where", "labels"])
def test_ignored_bad_token_gives_zeros_and_touches_nothing(path, mask):
  diff, rest, cot = _inputs(path)
  row = 7
  if mask == "where":
    rest = dict(rest, where=np.arange(T) != row)
  else:
    rest = dict(labels=np.where(np.arange(T) == row, -100, rest["labels"]).astype(np.int32))
  clean = _run(path, (diff, rest, cot), chunk_size=CHUNK)
  result = _run(path, _poison(path, (diff, rest, cot), row, np.nan), chunk_size=CHUNK)
  _assert_rows_equal(path, result, clean, np.arange(T) != row)
  (logp, entropy), grads = result
  assert logp[row] == 0 and entropy[row] == 0
  assert np.all(_token_grad(path, grads)[row] == 0)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_ignored_nan_hidden_state_leaves_weight_grad_finite(softcap):
  """Padding whose hidden state is garbage: with a softcap too, whose factor
  ``1 - tanh²(x / c)`` of a NaN logit must not reach the gradients as ``0 * NaN``."""
  diff, rest, cot = _inputs("linear")
  rest = dict(rest, where=np.arange(T) != 7)
  _, grads = _run("linear", _poison("linear", (diff, rest, cot), 7, np.nan), chunk_size=CHUNK,
                  logit_softcap=softcap)
  assert np.isfinite(grads["weight"]).all() and np.isfinite(grads["bias"]).all()
  assert np.all(grads["hidden"][7] == 0) and np.isfinite(grads["hidden"]).all()


@pytest.mark.parametrize("path,shards", [("logits", 1), ("logits", 2), ("linear", 2)])
def test_out_of_range_label_under_jit_is_nan_at_its_position_only(path, shards):
  diff, rest, cot = _inputs(path)
  clean = _run(path, (diff, rest, cot), shards=shards, chunk_size=CHUNK)
  labels = rest["labels"].copy()
  labels[6] = V  # one past the last column (of the last shard)
  (logp, entropy), grads = _run(path, (diff, dict(labels=labels), cot), shards=shards,
                                chunk_size=CHUNK)
  assert np.isnan(logp[6])
  others = np.arange(T) != 6
  _assert_rows_equal(path, ((logp, entropy), grads), clean, others)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_bad_temperature_under_jit_stays_in_its_token(path):
  diff, rest, cot = _inputs(path)
  temperature = np.linspace(0.5, 2.0, T).astype(np.float32)
  clean = _run(path, (diff, dict(rest, temperature=temperature), cot), chunk_size=CHUNK)
  for bad in (np.nan, 0.0, -1.0):
    t = temperature.copy()
    t[7] = bad
    result = _run(path, (diff, dict(rest, temperature=t), cot), chunk_size=CHUNK)
    _assert_rows_equal(path, result, clean, np.arange(T) != 7)


@pytest.mark.parametrize("path,shards", [("logits", 1), ("logits", 2), ("linear", 1),
                                         ("linear", 2)])
@pytest.mark.parametrize("mask", ["where", "labels"])
def test_fully_masked_batch_gives_zeros_and_zero_gradient(path, shards, mask):
  diff, rest, cot = _inputs(path)
  if mask == "where":
    rest = dict(rest, where=np.zeros(T, bool))
  else:
    rest = dict(labels=np.full(T, -100, np.int32))
  for options in (dict(chunk_size=CHUNK), dict(chunk_size=CHUNK, vocab_size=V - 3)):
    (logp, entropy), grads = _run(path, (diff, rest, cot), shards=shards, **options)
    assert np.all(logp == 0) and np.all(entropy == 0)
    for name, g in grads.items():
      assert np.all(g == 0), f"d {name} is not exactly zero: {g}"


def test_fully_masked_garbage_logits_give_zero_gradient():
  diff, rest, cot = _inputs("logits")
  diff = dict(logits=np.where(np.arange(V) % 2, np.nan, np.inf).astype(np.float32)
              + np.zeros((T, V), np.float32))
  (logp, entropy), grads = _run("logits", (diff, dict(labels=np.full(T, -100, np.int32)),
                                           cot), chunk_size=CHUNK)
  assert np.all(logp == 0) and np.all(entropy == 0) and np.all(grads["logits"] == 0)


@pytest.mark.parametrize("path,shards,jit", [("logits", 1, True), ("logits", 1, False),
                                             ("logits", 2, True), ("linear", 1, True),
                                             ("linear", 1, False), ("linear", 2, True)])
@pytest.mark.parametrize("shape", [(0,), (3, 0)])
def test_empty_input_gives_empty_outputs(path, shards, jit, shape):
  inputs = _inputs(path, shape=shape)
  (logp, entropy), grads = _run(path, inputs, shards=shards, jit=jit, chunk_size=CHUNK)
  assert logp.shape == entropy.shape == shape
  assert logp.dtype == entropy.dtype == np.float32
  for name, g in grads.items():
    assert g.shape == inputs[0][name].shape and g.dtype == np.float32
    assert np.all(g == 0)
