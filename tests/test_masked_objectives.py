"""Ignored tokens (``where=False`` and label -100) where they matter: objectives and
per-token losses that are NONZERO at the ignored tokens, so that a mask missing from the
loss sum, the cotangents, ``d logits``, ``d hidden`` or ``d W`` changes the numbers.

For ``token_loss`` (logits) and ``linear_token_loss`` (hidden, weight, bias), with a
constant objective, the entropy, a k3 KL term against a reference log-prob far from the
policy's (and overflowing to inf at the ignored tokens), a policy gradient with nonzero
advantages everywhere and GRPO with unit weights: the loss equals the float64 reference's
objective summed over kept tokens only, every gradient equals the reference's, the rows of
``d logits`` / ``d hidden`` of ignored tokens are exactly 0 and the returned log-probs and
entropies are exactly 0 there. For ``logprobs_and_entropy`` and
``linear_logprobs_and_entropy``, the same with ``sum(a * logp + b * entropy)``, ``a`` and
``b`` nonzero at every token. Locally (ragged chunks), inside ``shard_map`` with the
vocabulary over 2 devices, and through the ``sharded_*`` wrappers with the vocabulary or
the batch over 2 devices. Inputs are float64, so every entry is compared to 1e-10 of its
magnitude (at least 1).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from helpers import devices, jaxce, reference

objectives = jaxce.objectives
B, S, D, COLUMNS, VOCAB, CHUNK = 4, 5, 8, 64, 61, 3  # 20 tokens: a ragged last chunk


def _problem(seed):
  """Peaked logits through a head with a bias; ignored tokens of three kinds (``where``
  False with a real label, label -100 with ``where`` True, both); token args nonzero at
  every token, the reference log-prob 1000 (an overflowing k3 term) at ignored ones."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(B, S, D))
  weight = rng.normal(size=(D, COLUMNS)) * 0.8
  weight[:, rng.integers(0, VOCAB, 3)] *= 4  # peaked columns
  bias = rng.normal(size=COLUMNS)
  labels = rng.integers(0, VOCAB, (B, S))
  where = np.ones((B, S), bool)
  where[0, 3] = where[1, 0] = where[2, 2] = where[3, 4] = False
  labels[0, 1] = labels[3, 4] = labels[2, 0] = -100
  kept = where & (labels >= 0)
  advantages = rng.choice([-1.0, 1.0], (B, S)) * rng.uniform(0.5, 2.0, (B, S))
  old_logp = -rng.uniform(0.5, 5.0, (B, S))
  # Far below every log-prob (> -25 here): k3 = exp(d) - d - 1 ~ -d - 1 in [5, 31], so no
  # token dominates the comparisons; 1000 at ignored tokens: exp(1000 - 0) = inf.
  ref_logp = np.where(kept, -rng.uniform(30.0, 35.0, (B, S)), 1000.0)
  options = dict(where=where, vocab_size=VOCAB, temperature=rng.uniform(0.7, 1.3, (B, S)))
  return hidden, weight, bias, labels, kept, (advantages, old_logp, ref_logp), options


_grpo = objectives.grpo(0.2, 0.28, beta=0.04, entropy_coef=0.01)
_k3 = objectives.kl("k3")
OBJECTIVES = {  # objective(logp, entropy, advantages, old_logp, ref_logp), nonzero everywhere
    # 1 per token (the loss counts the kept tokens), a k3 term against a far reference
    # (inf at ignored tokens) and a policy gradient; the entropy is not computed.
    "constant + k3 + policy gradient": (
        lambda lp, h, adv, old, ref: 1.0 + _k3(lp, h, ref) - adv * lp),
    # GRPO (clip 0.2 / 0.28, k3, entropy bonus) with unit weights, plus the entropy itself.
    "grpo + entropy": lambda lp, h, adv, old, ref: _grpo(lp, h, adv, old, ref, 1.0) + h,
}
# Each objective locally (ragged chunks); on 2 devices, the one that uses every output:
# inside shard_map with the vocab split, and through the wrappers with the vocab or the
# batch split.
CASES = ([(name, path, "local") for name in OBJECTIVES for path in ("logits", "linear")]
         + [("grpo + entropy", path, mapping) for path, mapping in (
             ("logits", "shard_map"), ("linear", "shard_map"), ("linear", "sharded vocab"),
             ("logits", "sharded batch"))])
# The per-token paths locally with masks and nonzero cotangents everywhere: test_logits.py
# and test_linear.py; here on 2 devices.
PER_TOKEN_CASES = [("logits", "shard_map"), ("linear", "shard_map"), ("logits", "sharded vocab"),
                   ("linear", "sharded batch")]


def _mesh(mapping):
  """The 2-device mesh of a mapping: ("data", "v") as (1, 2) or, for the batch, (2, 1)."""
  shape = (2, 1) if mapping == "sharded batch" else (1, 2)
  return Mesh(np.array(devices(2)).reshape(shape), ("data", "v"))


def _call(mapping, local_fn, sharded_fn, arrays, specs, out_specs, **kw):
  """One call of a jaxce function on ``arrays`` the way ``mapping`` says: plainly,
  inside ``shard_map`` over the vocab (``specs``: each array's split; the function gets
  ``vocab_axis="v"``), or through the ``sharded_*`` wrapper."""
  if mapping == "local":
    return local_fn(*arrays, chunk_size=CHUNK, **kw)
  mesh = _mesh(mapping)
  if mapping == "shard_map":
    per_shard = lambda *a: local_fn(*a, chunk_size=CHUNK, vocab_axis="v", **kw)
    return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=out_specs)(*arrays)
  return sharded_fn(*arrays, mesh=mesh, vocab_axis="v", batch_axis="data", chunk_size=CHUNK,
                    **kw)


def _close(actual, expected, what):
  """Entry by entry within 1e-10 of the reference, relative to the entry (at least 1)."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
  ratio = np.abs(actual - expected) / (1e-10 * np.maximum(1.0, np.abs(expected)))
  worst = np.unravel_index(np.argmax(np.nan_to_num(ratio, nan=np.inf)), ratio.shape)
  assert np.all(ratio <= 1), (f"{what}: {actual[worst]!r} vs {expected[worst]!r} at {worst}, "
                              f"{float(ratio[worst]):.3g} x the 1e-10 bound")


def _exactly_zero(array, ignored, what):
  rows = np.asarray(array)[ignored]
  assert np.all(rows == 0), f"{what}: nonzero at ignored tokens, max |.| {np.abs(rows).max()}"


def _arrays(path, hidden, weight, bias):
  """``(arrays, shard_map in_specs, differentiated argnums)`` of a path."""
  if path == "logits":
    logits = np.einsum("bsd,dv->bsv", hidden, weight) + bias
    return (logits,), (P(None, None, "v"),), 0
  return (hidden, weight, bias), (P(), P(None, "v"), P("v")), (0, 1, 2)


def _reference_outputs(path, labels, options):
  """The float64 reference's ``(logp, entropy)`` as a function of the path's arrays."""
  if path == "logits":
    return lambda x: reference.logprobs_and_entropy(x, labels, **options)
  return lambda h, w, b: reference.linear_logprobs_and_entropy(h, w, labels, bias=b,
                                                               **options)


@functools.lru_cache(maxsize=None)
def _objective_reference(name, path):
  """``(loss, grads, (logp, entropy))`` of the reference: the objective summed over the
  kept tokens (computed once per objective and path; the mapped runs share it)."""
  hidden, weight, bias, labels, kept, args, options = _problem(1)
  arrays, _, argnums = _arrays(path, hidden, weight, bias)
  outputs = _reference_outputs(path, labels, options)

  def loss(*a):
    logp, entropy = outputs(*a)
    return jnp.sum(jnp.where(kept, OBJECTIVES[name](logp, entropy, *args), 0)), (logp, entropy)

  (value, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*arrays)
  return value, grads, out


def _check_all(path, value, grads, outputs, expected, ignored):
  """Loss, gradients and outputs against the reference's; the ignored tokens' outputs and
  gradient rows (d logits, or d hidden) exactly 0."""
  ref_value, ref_grads, ref_outputs = expected
  if value is not None:
    _close(value, ref_value, "loss")
  names = ("d logits",) if path == "logits" else ("d hidden", "d weight", "d bias")
  grads, ref_grads = ((grads,), (ref_grads,)) if path == "logits" else (grads, ref_grads)
  for what, g, r in zip(names, grads, ref_grads):
    _close(g, r, what)
  _exactly_zero(grads[0], ignored, names[0])
  for what, out, r in zip(("logp", "entropy"), outputs, ref_outputs):
    _close(out, r, what)
    _exactly_zero(out, ignored, what)


@pytest.mark.parametrize("name,path,mapping", CASES)
def test_objective_counts_kept_tokens_only(name, path, mapping):
  objective = OBJECTIVES[name]
  hidden, weight, bias, labels, kept, args, options = _problem(1)
  arrays, specs, argnums = _arrays(path, hidden, weight, bias)
  if path == "logits":
    call = lambda x, **k: jaxce.token_loss(objective, x, labels, *args, **k, **options)
    wrapped = lambda x, **k: jaxce.sharded_token_loss(objective, x, labels, *args, **k,
                                                       **options)
  else:
    call = lambda h, w, b, **k: jaxce.linear_token_loss(objective, h, w, labels, *args,
                                                        bias=b, **k, **options)
    wrapped = lambda h, w, b, **k: jaxce.sharded_linear_token_loss(
        objective, h, w, labels, *args, bias=b, **k, **options)
  uses_entropy = name == "grpo + entropy"
  out_specs = (P(), (P(), P() if uses_entropy else None))
  loss = lambda *a: _call(mapping, call, wrapped, a, specs, out_specs)
  (value, outputs), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*arrays)
  expected = _objective_reference(name, path)
  if not uses_entropy:  # not computed: None
    assert outputs[1] is None
    outputs, expected = outputs[:1], expected[:2] + (expected[2][:1],)
  _check_all(path, value, grads, outputs, expected, ~kept)


@pytest.mark.parametrize("path,mapping", PER_TOKEN_CASES)
def test_per_token_outputs_are_zero_at_ignored_tokens(path, mapping):
  """``sum(a * logp + b * entropy)`` with ``a``, ``b`` nonzero at every token: the
  outputs, their gradient rows at ignored tokens exactly 0, every gradient the
  reference's (d W and d bias get nothing from ignored tokens)."""
  hidden, weight, bias, labels, kept, _, options = _problem(2)
  rng = np.random.default_rng(3)
  a, b = rng.uniform(0.5, 2.0, (2, B, S)) * rng.choice([-1.0, 1.0], (2, B, S))
  arrays, specs, argnums = _arrays(path, hidden, weight, bias)
  if path == "logits":
    local = lambda x, **k: jaxce.logprobs_and_entropy(x, labels, **k, **options)
    wrapped = lambda x, **k: jaxce.sharded_logprobs_and_entropy(x, labels, **k, **options)
  else:
    local = lambda h, w, c, **k: jaxce.linear_logprobs_and_entropy(
        h, w, labels, bias=c, vocab_block_size=24, **k, **options)  # a ragged last block
    wrapped = lambda h, w, c, **k: jaxce.sharded_linear_logprobs_and_entropy(
        h, w, labels, bias=c, vocab_block_size=24, **k, **options)

  def loss(fn, *x):
    logp, entropy = fn(*x)
    return jnp.sum(a * logp + b * entropy), (logp, entropy)

  mapped = lambda *x: _call(mapping, local, wrapped, x, specs, (P(), P()))
  (value, outputs), grads = jax.jit(jax.value_and_grad(
      lambda *x: loss(mapped, *x), argnums, has_aux=True))(*arrays)
  (ref_value, ref_outputs), ref_grads = jax.jit(jax.value_and_grad(
      lambda *x: loss(_reference_outputs(path, labels, options), *x), argnums,
      has_aux=True))(*arrays)
  _check_all(path, value, grads, outputs, (ref_value, ref_grads, ref_outputs), ~kept)


def test_objective_cotangents_are_exactly_zero_at_dropped_tokens():
  """The objective's cotangents are zeroed at dropped tokens where they are formed (a NaN
  token argument there stays out), not only by ``logit_grad``'s mask downstream."""
  from jaxce._kernels import loss_terms  # pylint: disable=import-outside-toplevel
  keep = jnp.array([True, False, True])
  terms = lambda logp, entropy, a: a * (logp - 0.3 * entropy)
  _, g_logp, g_entropy = loss_terms.terms_and_cotangents(
      terms, jnp.ones(3), jnp.ones(3), [jnp.array([1.0, jnp.nan, 2.0])], keep, True)
  np.testing.assert_array_equal(g_logp, [1.0, 0.0, 2.0])
  np.testing.assert_array_equal(g_entropy, [-0.3, 0.0, -0.6])
