"""Entry-by-entry precision of the fused paths' bf16 gradients (``linear_token_loss`` and
``linear_logprobs_and_entropy``), on inputs with a realistic spread: hidden ~ N(0, 1),
weight ~ N(0, 1/D) with a few peaked columns, D = 64, T in the hundreds, V ~ 1000-1500.

A max-abs error over a whole array is set by its largest entries and cannot see an
accumulation in bf16: every entry is checked instead.

* Chunking: ``d W`` with different ``chunk_size`` values (and ``d hidden`` with different
  ``vocab_block_size`` values, over which it sums) agree entry by entry within one bf16
  ulp of the entry, plus the f32 reordering slack ``2 n 2^-24 S`` (n the terms of the
  sum, ``S = sum |terms|`` of the entry, from the float64 reference) and ``2 u M`` for
  one term whose bf16 ``d logits`` rounds the other way in the other program (``M`` the
  entry's largest |term|). Summed in f32 and rounded once, two orders give bf16 values
  at most one ulp apart; summed in bf16 after every chunk or block (checked: d W, and
  d hidden in either loop order), thousands of entries drift apart by up to 12 ulps.
* Against float64 (``jaxce.reference`` on float64 copies of the same bf16 values): every
  entry within half a bf16 ulp (the output's rounding) plus ``3 u R``, where
  ``u = 2^-8`` is bf16's unit roundoff and ``R = sqrt(sum terms^2)``: the matmuls take
  ``d logits`` rounded to bf16 (as ``hidden @ W`` in bf16 would), independent roundings
  of at most ``u |term|`` each, whose sum has a standard deviation of at most
  ``u R / sqrt(3)``; 3 u R is 5 of them. Relative to the entry, that is at most ``4 u``
  (1.6%) wherever the entry is not tiny (``|entry| >= R``).

Both loop orders of the per-token backward are covered (vocab blocks outer when
T <= V, token chunks outer when T > V). The logits path's ``d logits`` (no sums across
tokens) is checked entry by entry against float64 too: half a bf16 ulp.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import jaxce, reference

D = 64
U = 2.0**-8  # bf16's unit roundoff
F32 = 2.0**-24


def _problem(tokens, columns, seed):
  """bf16 hidden ~ N(0, 1), weight ~ N(0, 1/D) with 4 columns 8x larger (logits ~ N(0, 1),
  a few ~ N(0, 64)), labels, per-token cotangents for the log-prob and the entropy."""
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(tokens, D)), jnp.bfloat16)
  weight = rng.normal(size=(D, columns)) / np.sqrt(D)
  weight[:, rng.choice(columns, 4, replace=False)] *= 8
  weight = jnp.asarray(weight, jnp.bfloat16)
  labels = rng.integers(0, columns, tokens)
  a, b = rng.normal(size=(2, tokens))
  return hidden, weight, labels, a, b


def _bf16_ulp(x):
  """The bf16 spacing at each |x| (np.spacing of the bf16 value)."""
  return np.abs(np.spacing(np.abs(np.asarray(x, np.float64)).astype(jnp.bfloat16))).astype(
      np.float64)


def _grads(loss, hidden, weight):
  d_hidden, d_weight = jax.jit(jax.grad(loss, (0, 1)))(hidden, weight)
  assert d_hidden.dtype == d_weight.dtype == jnp.bfloat16
  return np.asarray(d_hidden, np.float64), np.asarray(d_weight, np.float64)


def _term_stats(x, y):
  """Of each entry of ``x @ y``: the sum of |terms| ``S``, the root of the sum of squared
  terms ``R`` and the largest |term| ``M``."""
  largest = np.zeros((x.shape[0], y.shape[1]))
  for k in range(0, x.shape[1], 64):  # [m, 64, n] at a time
    largest = np.maximum(largest, np.max(np.abs(x[:, k:k + 64, None] * y[None, k:k + 64]), 1))
  return np.abs(x) @ np.abs(y), np.sqrt(np.square(x) @ np.square(y)), largest


def _reference(hidden, weight, labels, a, b):
  """Float64 ``(d hidden, d W)`` of ``sum(a logp + b H)``, each with the
  ``_term_stats`` of its matmul (``d hidden = d W^T``, ``d W = h^T d`` with ``d`` the
  reference's d logits)."""
  h, w = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)

  def loss(x):
    logp, entropy = reference.logprobs_and_entropy(x, labels)
    return jnp.sum(a * logp + b * entropy)

  d = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(h @ w)))
  return (d @ w.T, _term_stats(d, w.T)), (h.T @ d, _term_stats(h.T, d))


def _check_orders_agree(got, other, stats, terms, what):
  """Two summation orders: within one bf16 ulp (of the larger), plus ``2 terms 2^-24 S``
  for the f32 sums' orders, plus ``2 u M`` for one term whose bf16 ``d logits`` rounds
  the other way (the two programs' f32 logits may differ in their last bit)."""
  s, _, m = stats
  ulp = _bf16_ulp(np.maximum(np.abs(got), np.abs(other)))
  limit = ulp + 2 * terms * F32 * s + 2 * U * m
  excess = np.abs(got - other) / limit
  worst = np.unravel_index(np.argmax(excess), excess.shape)
  assert np.all(excess <= 1), (
      f"{what}: {np.sum(excess > 1)} entries differ by more than 1 bf16 ulp (+ slack); at "
      f"{worst}: {got[worst]!r} vs {other[worst]!r}, {abs(got - other)[worst] / ulp[worst]:.0f} "
      "ulps")


def _check_against_float64(got, expected, stats, terms, what):
  """Half an ulp + 3 u R (+ the f32 slack) per entry, and the relative error of the
  entries that are not tiny (|entry| >= R) within 4 u."""
  s, r, _ = stats
  err = np.abs(got - expected)
  limit = 0.5 * _bf16_ulp(expected) + 3 * U * r + 2 * terms * F32 * s
  excess = err / limit
  worst = np.unravel_index(np.argmax(excess), excess.shape)
  assert np.all(excess <= 1), (
      f"{what}: {np.sum(excess > 1)} entries beyond half an ulp + 3 u R; at {worst}: "
      f"{got[worst]!r} vs {expected[worst]!r} (R = {r[worst]:.3g})")
  large = np.abs(expected) >= r
  assert large.mean() > 0.1, f"{what}: too few entries above R to check relative errors"
  relative = err[large] / np.abs(expected[large])
  assert relative.max() <= 4 * U, f"{what}: relative error {relative.max():.3g} > 4 u"


# (tokens, columns): vocab blocks outer (T <= V), token chunks outer (T > V).
SHAPES = {"vocab order": (320, 1531), "token order": (1100, 1031)}


@pytest.mark.parametrize("order", list(SHAPES))
def test_per_token_gradients_entrywise(order):
  """``linear_logprobs_and_entropy``: d W with chunks of 16 tokens against one chunk (the
  same vocab blocks of 128: the same d logits), d hidden with blocks of 128 columns
  against one block (the same chunks); each against float64."""
  tokens, columns = SHAPES[order]
  hidden, weight, labels, a, b = _problem(tokens, columns, seed=tokens)
  (d_hidden_ref, hidden_stats), (d_weight_ref, weight_stats) = _reference(
      hidden, weight, labels, a, b)

  def grads(chunk_size, vocab_block_size):
    def loss(h, w):
      logp, entropy = jaxce.linear_logprobs_and_entropy(
          h, w, labels, chunk_size=chunk_size, vocab_block_size=vocab_block_size)
      return jnp.sum(a * logp + b * entropy)
    return _grads(loss, hidden, weight)

  d_hidden, d_weight = grads(16, 128)
  _check_orders_agree(d_weight, grads(tokens, 128)[1], weight_stats, tokens,
                      "d W, chunks of 16 vs one chunk")
  _check_orders_agree(d_hidden, grads(16, columns)[0], hidden_stats, columns,
                      "d hidden, blocks of 128 vs one block")
  _check_against_float64(d_weight, d_weight_ref, weight_stats, tokens, "d W vs float64")
  _check_against_float64(d_hidden, d_hidden_ref, hidden_stats, columns, "d hidden vs float64")


def test_objective_gradients_entrywise():
  """``linear_token_loss`` (d W summed over the chunks, d hidden one matmul per chunk):
  chunks of 16 tokens against one chunk, entry by entry, and against float64."""
  tokens, columns = SHAPES["vocab order"]
  hidden, weight, labels, a, b = _problem(tokens, columns, seed=tokens)
  (d_hidden_ref, hidden_stats), (d_weight_ref, weight_stats) = _reference(
      hidden, weight, labels, a, b)
  objective = lambda logp, entropy, a, b: a * logp + b * entropy

  def grads(chunk_size):
    loss = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, a, b,
                                                chunk_size=chunk_size)[0]
    return _grads(loss, hidden, weight)

  d_hidden, d_weight = grads(16)
  one_hidden, one_weight = grads(tokens)
  _check_orders_agree(d_weight, one_weight, weight_stats, tokens,
                      "d W, chunks of 16 vs one chunk")
  _check_orders_agree(d_hidden, one_hidden, hidden_stats, columns,
                      "d hidden, chunks of 16 vs one")
  _check_against_float64(d_weight, d_weight_ref, weight_stats, tokens, "d W vs float64")
  _check_against_float64(d_hidden, d_hidden_ref, hidden_stats, columns, "d hidden vs float64")


@pytest.mark.parametrize("path", ["per-token", "objective"])
def test_logits_gradient_entrywise(path):
  """The logits path (``logprobs_and_entropy``, ``token_loss``), bf16 logits of the same
  spread and a per-token temperature: each entry of ``d logits`` is formed in f32 and
  rounded to bf16 once, so it lies within half a bf16 ulp of the float64 reference, plus
  2^-16 of the magnitudes it is made of (``|a| p``, ``|b| p (|log p| + H)``, ``|a|`` at
  the label: f32 rounding of the softmax, 2^-8 of a bf16 ulp). Softmax statistics in
  bf16, or a second rounding (say before the temperature's factor), are far outside."""
  tokens, columns = SHAPES["vocab order"]
  hidden, weight, labels, a, b = _problem(tokens, columns, seed=tokens)
  logits = jnp.asarray(jnp.dot(hidden, weight, preferred_element_type=jnp.float32),
                       jnp.bfloat16)
  temperature = np.random.default_rng(1).uniform(0.6, 1.4, tokens)
  exact = jnp.asarray(logits, jnp.float64)

  def ref_loss(x):
    logp, entropy = reference.logprobs_and_entropy(x, labels, temperature=temperature)
    return jnp.sum(a * logp + b * entropy)

  if path == "per-token":
    def loss(x):
      logp, entropy = jaxce.logprobs_and_entropy(x, labels, temperature=temperature,
                                                 chunk_size=16)
      return jnp.sum(a * logp + b * entropy)
  else:
    loss = lambda x: jaxce.token_loss(lambda lp, h, a, b: a * lp + b * h, x, labels, a, b,
                                      temperature=temperature, chunk_size=16)[0]
  got = jax.jit(jax.grad(loss))(logits)
  assert got.dtype == jnp.bfloat16
  got = np.asarray(got, np.float64)
  expected = np.asarray(jax.jit(jax.grad(ref_loss))(exact))
  log_p = np.asarray(jax.nn.log_softmax(exact / temperature[:, None]))
  p, entropy = np.exp(log_p), -np.sum(np.exp(log_p) * log_p, axis=-1, keepdims=True)
  onehot = np.arange(columns) == labels[:, None]
  magnitude = (np.abs(a)[:, None] * (p + onehot)
               + np.abs(b)[:, None] * p * (np.abs(log_p) + entropy)) / temperature[:, None]
  limit = 0.5 * _bf16_ulp(np.maximum(np.abs(got), np.abs(expected))) + 2.0**-16 * magnitude
  excess = np.abs(got - expected) / limit
  worst = np.unravel_index(np.argmax(excess), excess.shape)
  assert np.all(excess <= 1), (
      f"d logits: {np.sum(excess > 1)} entries beyond half an ulp (+ f32 slack); at "
      f"{worst}: {got[worst]!r} vs {expected[worst]!r}")
