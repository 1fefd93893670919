"""The fused paths' matmul precision: float32 operands get what ``jnp.dot`` gives them
(JAX's ``jax_default_matmul_precision`` where the call is traced, TF32 on GPUs by
default), or what ``precision=`` asks for; every matmul of the program takes it, and
``jaxce.plan.of`` says which. The suite sets "highest" globally (conftest.py): these tests
set JAX's default back where they test it, so on a GPU they run what users get."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import jaxce

T, D, V = 96, 256, 1009
ON_GPU = jax.default_backend() == "gpu"


def _problem(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(T, D))
  weight = rng.normal(size=(D, V)) * 2 / np.sqrt(D)
  weight[:, rng.integers(0, V, 8)] *= 4  # peaked columns
  labels = rng.integers(0, V, T)
  return jnp.asarray(hidden, dtype), jnp.asarray(weight, dtype), jnp.asarray(labels)


def _calls(labels, **kw):
  """The fused paths as a user differentiates them: name -> ``loss(h, w) -> (loss,
  logp)``."""
  objective = lambda logp, entropy: -logp + 0.01 * entropy
  per_token = lambda h, w: (lambda o: (jnp.sum(o[0]) + jnp.sum(o[1]), o[0]))(
      jaxce.linear_logprobs_and_entropy(h, w, labels, **kw))
  objective_path = lambda h, w: (lambda o: (o[0], o[1][0]))(
      jaxce.linear_token_loss(objective, h, w, labels, **kw))
  keep = jaxce.keep.from_csr(jnp.arange(T * 3) % V, jnp.arange(T + 1) * 3)
  kept_ids = lambda h, w: (lambda o: (jnp.sum(o[0]), o[0]))(
      jaxce.linear_logprobs_and_entropy(h, w, labels, keep=keep, **kw))
  # A kept id every other token: few enough that the kept ids themselves run (the
  # kept-ids kernel, linear_kept_ids), not their packed words (``kept_ids`` above).
  sparse = jaxce.keep.from_csr(jnp.arange(T // 2) * 7 % V, jnp.arange(T + 1) // 2)
  sparse_kept_ids = lambda h, w: (lambda o: (jnp.sum(o[0]), o[0]))(
      jaxce.linear_logprobs_and_entropy(h, w, labels, keep=sparse, **kw))
  return dict(per_token=per_token, objective=objective_path, kept_ids=kept_ids,
              sparse_kept_ids=sparse_kept_ids)


def _dot_precisions(jaxpr):
  """The ``precision`` of every dot_general in ``jaxpr``, nested jaxprs included."""
  found = []
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          found += _dot_precisions(sub)
  return found


@pytest.mark.parametrize("setting,argument,want", [
    ("default", None, "default"), ("highest", None, "highest"),
    ("default", "highest", "highest"), ("highest", jax.lax.Precision.DEFAULT, "default"),
    ("default", "float32", "highest"), ("default", "tensorfloat32", "high")])
def test_every_fused_matmul_takes_the_calls_precision(setting, argument, want):
  """``precision=None`` follows JAX's setting where the call is traced, as ``jnp.dot``
  does; an argument wins. ``jaxce.plan.of`` names it, and every matmul of the traced fwd+bwd
  (per-token path, objective path, kept ids) runs at it."""
  hidden, weight, labels = _problem()
  with jax.default_matmul_precision(setting):
    for name, loss in _calls(labels, precision=argument).items():
      assert jaxce.plan.of(loss, hidden, weight).precision == want, name
      assert jaxce.plan.of(loss, hidden, weight).kept_ids == (name == "sparse_kept_ids"), name
      grad = jax.grad(lambda h, w: loss(h, w)[0], (0, 1))
      precisions = _dot_precisions(jax.make_jaxpr(grad)(hidden, weight))
      assert precisions, name
      expected = (jax.lax.Precision[want.upper()],) * 2
      assert all(p == expected for p in precisions), (name, precisions)


def test_precision_is_checked_and_only_fused_calls_have_one():
  hidden, weight, labels = _problem()
  with pytest.raises(ValueError, match="precision must be None"):
    jaxce.linear_logprobs_and_entropy(hidden, weight, labels, precision="exact")
  logits = jnp.zeros((4, 8))  # (a logits plan has no matmul, and no precision field)
  assert not hasattr(jaxce.plan.of(jaxce.logprobs_and_entropy, logits, jnp.zeros(4, jnp.int32)),
                     "precision")
  assert jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels).precision


@pytest.mark.parametrize("path", ["per_token", "objective", "kept_ids"])
def test_float32_operands_get_what_jnp_dot_gives_them(path):
  """float32 ``hidden`` and ``weight`` against float64, at JAX's default precision (the
  suite's global "highest" set back to it here) and with ``precision="highest"``: the
  default as accurate as ``log_softmax(jnp.dot(hidden, weight))`` at that default (on GPUs
  TF32: about 1e-3 nats here, so the default is what runs), "highest" to float32's
  rounding everywhere."""
  hidden, weight, labels = _problem()
  h64, w64 = (np.asarray(a, np.float64) for a in (hidden, weight))
  logits64 = h64 @ w64
  logz = np.log(np.sum(np.exp(logits64 - logits64.max(1, keepdims=True)), 1)) + logits64.max(1)
  want = logits64[np.arange(T), np.asarray(labels)] - logz
  if path == "kept_ids":  # each token keeps columns 3t, 3t + 1, 3t + 2 (mod V) and its label
    rows, label_ids = np.arange(T), np.asarray(labels)
    kept = np.zeros((T, V), bool)
    kept[rows[:, None], (np.arange(T * 3) % V).reshape(T, 3)] = True
    kept[rows, label_ids] = True
    masked = np.where(kept, logits64, -np.inf)
    m = masked.max(1)
    want = masked[rows, label_ids] - (np.log(np.exp(masked - m[:, None]).sum(1)) + m)
  with jax.default_matmul_precision("default"):
    plain = jax.jit(lambda h, w: jnp.take_along_axis(jax.nn.log_softmax(jnp.dot(h, w)),
                                                     labels[:, None], 1)[:, 0])(hidden, weight)
    plain_error = np.max(np.abs(np.asarray(plain, np.float64)
                                - (logits64[np.arange(T), np.asarray(labels)] - logz)))
    errors = {}
    for precision in (None, "highest"):
      loss = _calls(labels, precision=precision)[path]
      logp = jax.jit(lambda h, w, loss=loss: loss(h, w)[1])(hidden, weight)
      errors[precision] = np.max(np.abs(np.asarray(logp, np.float64) - want))
  assert errors["highest"] <= 2e-5, errors
  assert errors[None] <= 2 * plain_error + 2e-5, (errors, plain_error)
  if ON_GPU:  # (JAX's default there is TF32: three digits fewer than "highest")
    assert errors[None] > 10 * errors["highest"], (errors, plain_error)
