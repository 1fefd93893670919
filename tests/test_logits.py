"""The logits path against the float64 reference: values, gradients, options."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from helpers import (TOLERANCE, adversarial_logits, assert_close, jaxce, kernel_device, reference,
                     value_and_grads)


def _case(seed, shape, num_columns, vocab_size=None, ignore=0.2):
  rng = np.random.default_rng(seed)
  logits = adversarial_logits(rng, shape + (num_columns,))
  labels = rng.integers(0, vocab_size or num_columns, shape)
  labels[rng.random(shape) < ignore] = -100
  return rng, logits, labels, dict(labels=labels, cot_logp=rng.normal(size=shape),
                                   cot_entropy=rng.normal(size=shape))


def _check(logits, dtype, loss_kw, **kw):
  x = jnp.asarray(logits, dtype)
  (logp, ent), grad = value_and_grads(jaxce.logprobs_and_entropy, (x,), 0, **loss_kw, **kw)
  ref_kw = {k: v for k, v in kw.items()
            if k not in ("chunk_size", "implementation", "backward_in_place")}
  (logp_ref, ent_ref), grad_ref = value_and_grads(
      reference.logprobs_and_entropy, (jnp.asarray(x, jnp.float64),), 0, **loss_kw, **ref_kw)
  tol = TOLERANCE[dtype]
  assert logp.dtype == jnp.promote_types(dtype, jnp.float32)
  assert grad.dtype == x.dtype
  assert_close(logp, logp_ref, tol["value"], "logp")
  if kw.get("return_entropy", True):
    assert_close(ent, ent_ref, tol["value"], "entropy")
  else:
    assert ent is None and ent_ref is None
  assert_close(grad, grad_ref, tol["grad"], "grad")
  return logp, ent, grad


@pytest.mark.parametrize("chunk_size", [1, 7, 36, 37, 38, 100, None])
def test_chunk_sizes_match_reference(chunk_size):
  _, logits, labels, loss_kw = _case(0, (37,), 1009)
  _check(logits, jnp.float32, loss_kw, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [7, 37, 38])  # ragged tail; exact; one step
@pytest.mark.parametrize("in_place", [True, False])
def test_both_backward_formulations_match_reference(chunk_size, in_place):
  _, logits, labels, loss_kw = _case(11, (37,), 1009)
  _check(logits, jnp.float32, loss_kw, chunk_size=chunk_size, backward_in_place=in_place)


def test_donated_logits_under_jit():
  _, logits, labels, loss_kw = _case(2, (10,), 131)
  expected = jax.grad(lambda x: jnp.sum(
      loss_kw["cot_logp"] * reference.logprobs_and_entropy(x, labels)[0]))(logits)
  step = jax.jit(jax.grad(lambda x: jnp.sum(loss_kw["cot_logp"] * jaxce.logprobs_and_entropy(
      x, labels, chunk_size=3)[0])), donate_argnums=0)
  assert_close(step(jnp.asarray(logits, jnp.float32)), expected, 2e-5, "donated grad")


def test_single_token_and_leading_dims():
  _, logits, labels, loss_kw = _case(3, (1,), 50)
  _check(logits, jnp.float32, loss_kw)
  _, logits, labels, loss_kw = _case(4, (3, 5), 211)
  logp, _, grad = _check(logits, jnp.float32, loss_kw, chunk_size=4)
  assert logp.shape == (3, 5) and grad.shape == (3, 5, 211)


@pytest.mark.parametrize("temperature", [0.7, "per_sample", "per_token"])
def test_temperature(temperature):
  rng, logits, labels, loss_kw = _case(5, (4, 6), 300)
  if temperature == "per_sample":
    temperature = rng.uniform(0.3, 2.0, (4, 1))
  elif temperature == "per_token":
    temperature = rng.uniform(0.3, 2.0, (4, 6))
  _check(logits, jnp.float32, loss_kw, chunk_size=5, temperature=temperature)


def test_where_mask_and_negative_labels_get_exact_zero():
  rng, logits, labels, loss_kw = _case(6, (20,), 97, ignore=0.3)
  where = rng.random(20) < 0.7
  logp, ent, grad = _check(logits, jnp.float32, loss_kw, chunk_size=6, where=where)
  ignored = ~where | (labels < 0)
  assert ignored.any() and (~ignored).any()
  assert np.all(np.asarray(logp)[ignored] == 0) and np.all(np.asarray(ent)[ignored] == 0)
  assert np.all(np.asarray(grad)[ignored] == 0)


def test_padded_vocab_with_garbage_padding():
  # Columns >= vocab_size hold huge values: they must not leak into max, sum or entropy.
  _, logits, labels, loss_kw = _case(7, (15,), 1024, vocab_size=1009)
  logits[:, 1009:] = 1e4
  logp, ent, grad = _check(logits, jnp.float32, loss_kw, chunk_size=4, vocab_size=1009)
  assert np.all(np.asarray(grad)[:, 1009:] == 0)
  assert np.all(np.asarray(logp) <= 0)


@pytest.mark.parametrize("offset", [-300.0, 300.0])
def test_shifted_and_all_negative_logits(offset):
  _, logits, labels, loss_kw = _case(8, (9,), 333)
  logits = logits + offset
  if offset < 0:
    assert np.all(logits < 0)
  _check(logits, jnp.float32, loss_kw, chunk_size=4)


def test_banned_tokens_minus_inf():
  rng = np.random.default_rng(9)
  logits = adversarial_logits(rng, (11, 200), banned=0.3)
  labels = np.array([int(np.flatnonzero(np.isfinite(row))[0]) for row in logits])
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=11), cot_entropy=rng.normal(size=11))
  logp, ent, grad = _check(logits, jnp.float32, loss_kw, chunk_size=3)
  assert np.all(np.isfinite(np.asarray(grad)))
  assert np.all(np.asarray(grad)[np.isneginf(logits)] == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_no_worse_than_plain_jax(dtype):
  _, logits, labels, loss_kw = _case(10, (24,), 509)
  logits = logits / 2  # keep f16 in range
  x = jnp.asarray(logits, dtype)
  (logp, ent), grad = value_and_grads(jaxce.logprobs_and_entropy, (x,), 0, chunk_size=5, **loss_kw)
  (logp_p, ent_p), grad_p = value_and_grads(reference.logprobs_and_entropy, (x,), 0, **loss_kw)
  (logp_r, ent_r), grad_r = value_and_grads(
      reference.logprobs_and_entropy, (jnp.asarray(x, jnp.float64),), 0, **loss_kw)
  assert logp.dtype == jnp.float32 and grad.dtype == dtype
  for name, a, p, r in (("logp", logp, logp_p, logp_r), ("entropy", ent, ent_p, ent_r),
                        ("grad", grad, grad_p, grad_r)):
    err = np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r)))
    plain = np.max(np.abs(np.asarray(p, np.float64) - np.asarray(r)))
    assert err <= plain + 1e-6, f"{name}: jaxce {err:.2e} vs plain JAX {plain:.2e}"


def test_out_of_range_label_raises_when_concrete_and_nan_under_jit():
  _, logits, labels, _ = _case(11, (6,), 64, vocab_size=60)
  labels[4] = 61
  with pytest.raises(ValueError, match=r"labels\[\(4,\)\] = 61 .*vocab_size=60"):
    jaxce.logprobs_and_entropy(logits, labels, vocab_size=60)
  logp, _ = jax.jit(lambda x, l: jaxce.logprobs_and_entropy(x, l, vocab_size=60))(logits, labels)
  logp = np.asarray(logp)
  assert np.isnan(logp[4]) and np.all(np.isfinite(np.delete(logp, 4)))
  labels[4] = -100  # ignored positions may hold anything
  jaxce.logprobs_and_entropy(logits, labels, vocab_size=60)


def test_check_grads_float64():
  _, logits, labels, _ = _case(12, (5,), 13, ignore=0.0)
  f = lambda x: jaxce.logprobs_and_entropy(x, labels, chunk_size=2, temperature=0.9)
  check_grads(f, (jnp.asarray(logits / 5),), order=1, modes=["rev"])


def test_return_entropy_false():
  _, logits, labels, loss_kw = _case(13, (8,), 77)
  logp, ent = jaxce.logprobs_and_entropy(logits, labels, return_entropy=False)
  assert ent is None
  assert_close(logp, reference.logprobs_and_entropy(logits, labels)[0], 1e-10, "logp")
  loss_kw["cot_entropy"] = None
  _check(logits, jnp.float32, loss_kw, return_entropy=False, chunk_size=3)


def test_transformations_jit_vmap_checkpoint():
  _, logits, labels, loss_kw = _case(14, (3, 7), 90)
  f = lambda x, l: jaxce.logprobs_and_entropy(x, l, chunk_size=3)
  expected = reference.logprobs_and_entropy(logits, labels)
  for g in (jax.jit(f), jax.vmap(f), jax.checkpoint(f)):
    out = g(logits, labels)
    assert_close(out[0], expected[0], 1e-10, "logp")
    assert_close(out[1], expected[1], 1e-10, "entropy")
  loss = lambda x: jnp.sum(loss_kw["cot_logp"] * f(x, labels)[0])
  ref_loss = lambda x: jnp.sum(loss_kw["cot_logp"] * reference.logprobs_and_entropy(x, labels)[0])
  assert_close(jax.grad(jax.checkpoint(loss))(logits), jax.grad(ref_loss)(logits), 1e-10, "grad")
  vm = jax.vmap(jax.grad(lambda x, l, c: jnp.sum(c * f(x, l)[0])))(logits, labels, loss_kw["cot_logp"])
  assert_close(vm, jax.grad(ref_loss)(logits), 1e-10, "vmap grad")


def test_unused_outputs_get_no_gradient_work():
  """Symbolic zeros: stop_gradient(entropy) gives the log-prob-only gradient, and vice versa."""
  _, logits, labels, loss_kw = _case(15, (9,), 120)
  a, b = loss_kw["cot_logp"], loss_kw["cot_entropy"]
  f = lambda x: jaxce.logprobs_and_entropy(x, labels, chunk_size=4)
  g_logp = jax.grad(lambda x: jnp.sum(a * f(x)[0]))(logits)
  g_stop = jax.grad(lambda x: jnp.sum(a * f(x)[0]) + jnp.sum(b * jax.lax.stop_gradient(f(x)[1])))(logits)
  g_ref = jax.grad(lambda x: jnp.sum(a * reference.logprobs_and_entropy(x, labels)[0]))(logits)
  assert_close(g_logp, g_ref, 1e-10, "logp-only grad")
  assert_close(g_stop, g_ref, 1e-10, "stopped-entropy grad")
  g_ent = jax.grad(lambda x: jnp.sum(b * f(x)[1]))(logits)
  g_ent_ref = jax.grad(lambda x: jnp.sum(b * reference.logprobs_and_entropy(x, labels)[1]))(logits)
  assert_close(g_ent, g_ent_ref, 1e-10, "entropy-only grad")


@pytest.mark.parametrize("case", ["peaked", "padded_shifted", "banned", "tiny_vocab"])
def test_pallas_forward_matches_reference(case):
  """The GPU kernel, run in Pallas interpret mode: same values and gradients."""
  rng = np.random.default_rng(16)
  num_columns, vocab_size, offset, banned = {
      "peaked": (1009, None, 0.0, 0.0), "padded_shifted": (4100, 4097, -300.0, 0.0),
      "banned": (515, None, 0.0, 0.3), "tiny_vocab": (3, None, 0.0, 0.0)}[case]
  logits = adversarial_logits(rng, (6, num_columns), offset=offset, banned=banned)
  labels = rng.integers(0, vocab_size or num_columns, 6)
  labels[2] = -100
  if banned:
    labels = np.array([int(np.flatnonzero(np.isfinite(r))[-1]) for r in logits])
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=6), cot_entropy=rng.normal(size=6))
  _check(logits, jnp.float32, loss_kw, implementation="pallas", vocab_size=vocab_size,
         temperature=rng.uniform(0.5, 2.0, 6))


@pytest.mark.parametrize("num_columns,start,limit", [
    (512, 0, 512),    # whole blocks only
    (300, 0, 300),    # a tail past the last whole block, read clamped back
    (300, 5, 300),    # a partial head block
    (300, 256, 300),  # an aligned start, a tail only
    (300, 260, 290),  # head and end inside the clamped last block
    (300, 7, 9),      # a range inside one block
    (300, 1, 257),    # a head from column 1, a tail of one column
    (300, 100, 100),  # an empty range
    (1030, 3, 1029)])
def test_pallas_row_statistics_column_ranges(num_columns, start, limit):
  """The kernel's ``(m, s, q)`` over ``[start, limit)`` (Pallas interpret mode) against
  float64: the log-sum-exp ``m + log s`` and the entropy ``log s - q / s``."""
  from jaxce._kernels.triton import rows as triton_rows
  rng = np.random.default_rng(num_columns + start + limit)
  logits = adversarial_logits(rng, (3, num_columns), offset=-40.0, peak=0.0)
  # Peaks at the range's ends and inside it: a column counted twice or left out shows.
  logits[np.arange(3), [start, max(limit - 1, start), (start + limit) // 2]] += 25.0
  inv_temp = rng.uniform(0.5, 2.0, 3)
  m, s, q = (np.asarray(a, np.float64) for a in triton_rows.row_statistics(
      jnp.asarray(logits, jnp.float32), jnp.asarray(inv_temp, jnp.float32), limit, True,
      start=start, interpret=kernel_device()["interpret"]))
  if start == limit:
    np.testing.assert_array_equal(s, 0.0)
    return
  z = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)[:, start:limit] * inv_temp[:, None]
  lse = np.log(np.sum(np.exp(z - z.max(1, keepdims=True)), 1)) + z.max(1)
  p = np.exp(z - lse[:, None])
  assert_close(m + np.log(s), lse, 1e-5, "log-sum-exp")
  assert_close(np.log(s) - q / s, -np.sum(p * np.log(p), 1), 1e-5, "entropy")


def test_implementation_is_checked():
  with pytest.raises(ValueError, match="implementation"):
    jaxce.logprobs_and_entropy(jnp.zeros((2, 5)), jnp.zeros(2, jnp.int32), implementation="cuda")


def test_chunk_size_recompiles_only_where_it_is_used():
  """The Pallas forward with the one-pass backward runs no chunks: another ``chunk_size``
  reuses the compiled program; XLA's forward and the in-place backward use it."""
  from jaxce._kernels import logits
  x, labels = jnp.ones((16, 40), jnp.float32), jnp.arange(16, dtype=jnp.int32)
  compiled = logits._jitted_logprobs_entropy._cache_size
  for implementation, backward_in_place, new_programs in [
      ("pallas", False, 1), ("xla", False, 2), ("pallas", True, 2)]:
    before = compiled()
    for chunk_size in (4, 8):
      jaxce.logprobs_and_entropy(x, labels, chunk_size=chunk_size,
                                 implementation=implementation,
                                 backward_in_place=backward_in_place)
    assert compiled() - before == new_programs, (implementation, backward_in_place)
