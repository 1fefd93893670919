"""Kept sets (``keep=``): the softmax over each token's kept columns only, on the logits,
fused and objective paths, against a float64 reference that sets the dropped logits to
-inf; peaked logits whose arg-max is dropped, a kept set of one token, all kept (bitwise
the call without ``keep``), labels outside their kept set (finite everywhere), padded
vocabulary, per-token temperature, softcap, ragged chunks and blocks; the vocabulary split
over 2, 4 and 8 simulated devices; the helpers against NumPy; no ``[T, V]`` mask in the
compiled plan; the planner keeps kept sets on the Mosaic kernels; vLLM's CSR kept ids
(``from_csr``) against NumPy and through ``keep=``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import adversarial_logits, assert_close, devices, jaxce, reference

T, V, D, VOCAB = 13, 101, 8, 97  # V columns, the last 4 padding
TOL = dict(value=1e-10, grad=1e-10)  # float64 inputs: the same maths, other order


@pytest.fixture(autouse=True)
def _kept_ids_at_these_sizes(monkeypatch):
  """The planner takes kept ids as they are while their entries are at most a fraction of
  the logits measured on full-size heads (1/560 of ``T x V`` on the fused path); a
  sampler-like set over this file's ~100 columns is far more, so the tests raise it to keep
  the kept-ids kernels under test (``test_the_planner_s_threshold_at_full_size`` tests
  the real one)."""
  monkeypatch.setattr(jaxce.plan, "KEPT_IDS_FRACTION", {"fused": 1 / 2, "logits": 1 / 2})


def _problem(seed=0, columns=V, tokens=T):
  """Peaked, shifted logits; kept sets of ~30 % that drop some rows' arg-max, one row
  with a single kept column (its label), one row whose label is outside its kept set;
  random per-token cotangents."""
  rng = np.random.default_rng(seed)
  logits = adversarial_logits(rng, (tokens, columns), offset=-30.0)
  labels = rng.integers(0, min(VOCAB, columns), tokens)
  mask = rng.random((tokens, columns)) < 0.3
  mask[np.arange(tokens), labels] = True
  mask[0, np.argmax(logits[0])] = False  # the arg-max dropped
  mask[1] = False
  mask[1, labels[1]] = True  # one kept token: the label
  mask[2, labels[2]] = False  # a label outside its kept set
  return dict(logits=logits, labels=labels, mask=mask, keep=jaxce.keep.pack(mask),
              temperature=rng.uniform(0.6, 1.4, tokens), where=rng.random(tokens) < 0.9,
              cot=rng.normal(size=(2, tokens)), hidden=rng.normal(size=(tokens, D)),
              weight=rng.normal(size=(D, columns)) * 1.5, labels_ignored=labels)


def _weighted(fn, cot):
  def loss(*arrays):
    logp, entropy = fn(*arrays)
    return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * entropy)
  return loss


def _check(fn, ref, arrays, cot, argnums):
  """Outputs and gradients of ``fn`` against ``ref``, each computed in one jitted call."""
  both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(_weighted(f, cot), argnums)(*a)))
  (got, grads), (want, grads_ref) = both(fn)(*arrays), both(ref)(*arrays)
  for name, g, w in zip(("logp", "entropy"), got, want):
    assert_close(g, w, TOL["value"], name)
  for k, (g, w) in enumerate(zip(grads, grads_ref)):
    assert np.all(np.isfinite(np.asarray(g))), f"grad {k}: not finite"
    assert_close(g, w, TOL["grad"], f"grad {k}")
  return got, grads


@pytest.mark.parametrize("kw", [{}, dict(backward_in_place=True, chunk_size=5)])
def test_logits_path(kw):
  p = _problem()
  options = dict(labels=p["labels"], keep=p["keep"], temperature=p["temperature"],
                 where=p["where"], vocab_size=VOCAB)
  fn = lambda x: jaxce.logprobs_and_entropy(x, **options, **kw)
  ref = lambda x: reference.logprobs_and_entropy(x, **options)
  (logp, entropy), (grad,) = _check(fn, ref, (jnp.asarray(p["logits"]),), p["cot"], (0,))
  # the one kept token: log-prob 0, entropy 0, zero gradient; dropped columns: zero gradient
  assert abs(float(logp[1])) < 1e-12 and abs(float(entropy[1])) < 1e-12
  assert np.all(np.asarray(grad)[1] == 0)
  dropped = ~np.asarray(jaxce.keep.unpack(p["keep"], V))
  dropped[np.arange(T), p["labels"]] = False
  assert np.all(np.asarray(grad)[dropped] == 0)
  # the dropped arg-max changes the answer (the test would see a keep that is ignored)
  plain = jaxce.logprobs_and_entropy(jnp.asarray(p["logits"]), p["labels"], vocab_size=VOCAB,
                                     temperature=p["temperature"])
  assert abs(float(plain[0][0]) - float(logp[0])) > 1.0


@pytest.mark.parametrize("kw", [dict(chunk_size=4, vocab_block_size=20),
                                dict(chunk_size=5, vocab_block_size=40, logit_softcap=20.0,
                                     weight_layout="vd")])
def test_fused_path(kw):
  """Ragged chunks and blocks whose columns do not start at a multiple of 32, the
  token-outer backward (13 tokens, blocks of 20 columns) and the vocab-outer one (40)."""
  p = _problem(1)
  layout = kw.get("weight_layout", "dv")
  weight = p["weight"] if layout == "dv" else p["weight"].T
  options = dict(labels=p["labels"], keep=p["keep"], temperature=p["temperature"],
                 where=p["where"], vocab_size=VOCAB, weight_layout=layout,
                 logit_softcap=kw.get("logit_softcap"),
                 bias=jnp.asarray(np.linspace(-3, 3, V)))
  fn = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, **options, **{
      k: v for k, v in kw.items() if k not in options})
  ref = lambda h, w: reference.linear_logprobs_and_entropy(h, w, **options)
  _check(fn, ref, (jnp.asarray(p["hidden"]), jnp.asarray(weight)), p["cot"], (0, 1))


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_objective_paths(path):
  p = _problem(2)
  objective = lambda logp, entropy, adv: -adv * logp + 0.1 * entropy + 0.3
  adv = jnp.asarray(p["cot"][0])
  options = dict(labels=p["labels"], keep=p["keep"], temperature=p["temperature"],
                 where=p["where"], vocab_size=VOCAB)
  valid = p["where"] & (p["labels"] >= 0)
  if path == "logits":
    arrays, argnums = (jnp.asarray(p["logits"]),), (0,)
    fn = lambda x: jaxce.token_loss(objective, x, options["labels"], adv, chunk_size=4,
                                    **{k: v for k, v in options.items() if k != "labels"})[0]
    per_token = lambda x: reference.logprobs_and_entropy(x, **options)
  else:
    arrays, argnums = (jnp.asarray(p["hidden"]), jnp.asarray(p["weight"])), (0, 1)
    fn = lambda h, w: jaxce.linear_token_loss(
        objective, h, w, options["labels"], adv, chunk_size=4,
        **{k: v for k, v in options.items() if k != "labels"})[0]
    per_token = lambda h, w: reference.linear_logprobs_and_entropy(h, w, **options)

  def ref(*a):
    logp, entropy = per_token(*a)
    return jnp.sum(jnp.where(valid, objective(logp, entropy, adv), 0))

  (loss, grads), (loss_ref, grads_ref) = (jax.jit(jax.value_and_grad(f, argnums))(*arrays)
                                          for f in (fn, ref))
  assert_close(loss, loss_ref, 1e-10, "loss")
  for g, w in zip(grads, grads_ref):
    assert_close(g, w, 1e-10, "grad")


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_all_kept_is_the_call_without_keep_bitwise(path):
  """Per implementation (XLA: on GPUs the call without keep would take a Pallas kernel).

  Bitwise where XLA compiles the two programs' matmuls alike (CPU). On a GPU XLA's
  autotuner picks each program's GEMM per process (cuBLAS, or a Triton fusion that takes
  the kept mask's selects in), so a one-row chunk's ``d hidden`` was seen one or two f32
  ulps apart there (bench/NOTES.md, entries 39 and 40): the GPU compares within an f32
  GEMM's rounding, relative to each output's largest entry."""
  p = _problem(3)
  keep = jaxce.keep.pack(np.ones((T, V), bool))
  if path == "logits":
    arrays = (jnp.asarray(p["logits"], jnp.float32),)
    fn = lambda keep: lambda x: jaxce.logprobs_and_entropy(x, p["labels"], keep=keep,
                                                           chunk_size=4, implementation="xla")
  else:
    arrays = (jnp.asarray(p["hidden"], jnp.float32), jnp.asarray(p["weight"], jnp.float32))
    fn = lambda keep: lambda h, w: jaxce.linear_logprobs_and_entropy(
        h, w, p["labels"], keep=keep, chunk_size=4, vocab_block_size=40, implementation="xla")
  argnums = tuple(range(len(arrays)))
  cot = jnp.asarray(p["cot"], jnp.float32)
  both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(_weighted(f, cot), argnums)(*a)))
  with_keep, without = both(fn(keep))(*arrays), both(fn(None))(*arrays)
  for a, b in zip(jax.tree.leaves(with_keep), jax.tree.leaves(without)):
    if jax.default_backend() == "gpu":
      np.testing.assert_allclose(a, b, rtol=0, atol=2**-20 * float(np.max(np.abs(b))))
    else:
      np.testing.assert_array_equal(a, b)


def test_a_label_outside_its_kept_set_stays_finite_and_is_found():
  """Row 2's label is outside its kept set: its column counts as kept (the reference
  does the same), nothing is NaN or inf, and jaxce.keep.check names the position."""
  p = _problem(4)
  x = jnp.asarray(p["logits"])
  logp, entropy = jaxce.logprobs_and_entropy(x, p["labels"], keep=p["keep"])
  assert np.all(np.isfinite(logp)) and np.all(np.isfinite(entropy))
  grad = jax.grad(lambda x: jnp.sum(jaxce.logprobs_and_entropy(x, p["labels"],
                                                               keep=p["keep"])[0]))(x)
  assert np.all(np.isfinite(grad))
  with pytest.raises(ValueError, match=r"labels\[\(2,\)\] = \d+ is not in its kept set "
                                       r"\(1 such position"):
    jaxce.keep.check(p["keep"], p["labels"])
  # An ignored label (-100) is never outside its kept set, even where column 0 (where a
  # careless check would look) is not kept; the same row with label 0 is.
  keep = np.array(p["keep"])
  keep[2, 0] &= ~np.uint32(1)
  with pytest.raises(ValueError, match=r"labels\[\(2,\)\] = 0 is not in its kept set"):
    jaxce.keep.check(keep, np.where(np.arange(T) == 2, 0, p["labels"]))
  jaxce.keep.check(keep, np.where(np.arange(T) == 2, -100, p["labels"]))


def _kept_ids(mask, rng):
  """``mask``'s kept sets as vLLM hands them over: CSR ids in a random order within each
  token, one repeated id, a -1 pad and unused entries past the end; and the words."""
  rows = [list(rng.permutation(np.flatnonzero(r))) for r in mask]
  rows[0] += rows[0][:1] + [-1]
  offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
  flat = np.array(sum(rows, []) + [0, 5, 7], np.int32)
  return jaxce.keep.from_csr(flat, offsets)


def _sparse_problem(seed, columns=V, tokens=T):
  """``_problem`` with the sampler's small kept sets (~5 % of the columns) as kept ids."""
  p = _problem(seed, columns, tokens)
  rng = np.random.default_rng(seed + 100)
  mask = rng.random((tokens, columns)) < 0.05
  mask[np.arange(tokens), p["labels"]] = True
  mask[1] = False
  mask[1, p["labels"][1]] = True  # one kept token: the label
  mask[2, p["labels"][2]] = False  # a label outside its kept set
  return dict(p, mask=mask, keep=jaxce.keep.pack(mask), kept_ids=_kept_ids(mask, rng))


@pytest.fixture
def kept_ids_blocks(monkeypatch):
  """The fused kept-ids kernel walking its entries in blocks of at most 24 (a function of
  ``BLOCK``: traces made with the default are dropped before and after)."""
  from jaxce._kernels import linear_kept_ids  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(linear_kept_ids, "BLOCK", 24)
  jax.clear_caches()
  yield
  jax.clear_caches()


@pytest.mark.parametrize("kw", [{}, dict(logit_softcap=20.0, weight_layout="vd", bias=True),
                                dict(blocks=True), dict(blocks=True, weight_layout="vd")])
def test_kept_ids_on_the_fused_path(kw, request):
  """Only the kept columns' logits: against the float64 reference (values and gradients,
  the one-kept token's zeros, no gradient to a dropped column) and the plan says so; the
  entries in one block or (``blocks``) several of equal size, each token's run crossing
  their edges."""
  if kw.get("blocks"):
    request.getfixturevalue("kept_ids_blocks")
  p = _sparse_problem(11)
  layout = kw.get("weight_layout", "dv")
  weight = p["weight"] if layout == "dv" else p["weight"].T
  options = dict(labels=p["labels"], temperature=p["temperature"], where=p["where"],
                 vocab_size=VOCAB, weight_layout=layout, logit_softcap=kw.get("logit_softcap"),
                 bias=jnp.asarray(np.linspace(-3, 3, V)) if kw.get("bias") else None)
  fn = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, keep=p["kept_ids"], **options)
  ref = lambda h, w: reference.linear_logprobs_and_entropy(h, w, keep=p["keep"], **options)
  arrays = (jnp.asarray(p["hidden"]), jnp.asarray(weight))
  assert jaxce.plan.of(fn, *arrays).kept_ids
  (logp, entropy), (_, d_weight) = _check(fn, ref, arrays, p["cot"], (0, 1))
  assert abs(float(logp[1])) < 1e-12 and abs(float(entropy[1])) < 1e-12
  touched = p["mask"] | (np.arange(V) == p["labels"][:, None])
  touched = (touched & p["where"][:, None]).any(0)
  d_weight = np.asarray(d_weight) if layout == "vd" else np.asarray(d_weight).T
  assert np.all(d_weight[~touched] == 0)


@pytest.mark.parametrize("return_entropy", [True, False])
def test_kept_ids_bias_gradient_leading_dims_and_logp_only(return_entropy):
  """The bias's gradient too, labels of shape [2, 6] (ids index the flattened tokens), and
  the log-prob alone."""
  p = _sparse_problem(14, tokens=12)
  shape = (2, 6)
  h = jnp.asarray(p["hidden"]).reshape(*shape, D)
  arrays = (h, jnp.asarray(p["weight"]), jnp.asarray(np.linspace(-2, 2, V)))
  options = dict(labels=p["labels"].reshape(shape), temperature=p["temperature"].reshape(shape),
                 vocab_size=VOCAB, return_entropy=return_entropy)
  cot = p["cot"].reshape(2, *shape)

  def loss(fn, keep):
    def value(h, w, b):
      logp, entropy = fn(h, w, bias=b, keep=keep, **options)
      return jnp.sum(cot[0] * logp) + (0 if entropy is None else jnp.sum(cot[1] * entropy))
    return jax.value_and_grad(value, (0, 1, 2))(*arrays)

  assert jaxce.plan.of(jaxce.linear_logprobs_and_entropy, *arrays[:2], keep=p["kept_ids"],
                       **options).kept_ids
  got = loss(jaxce.linear_logprobs_and_entropy, p["kept_ids"])
  want = loss(reference.linear_logprobs_and_entropy, p["keep"].reshape(*shape, -1))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_close(g, w, 1e-10, "value and gradients")


@pytest.mark.parametrize("path", ["logits", "token_loss", "linear_token_loss", "shard_map",
                                  "sharded"])
def test_kept_ids_everywhere_as_the_packed_words(path):
  """Every other function (and the fused path over 4 vocab shards: inside shard_map only
  its columns' ids; ``sharded_*`` on packed words) gives the packed words' numbers."""
  p = _sparse_problem(12, columns=128, tokens=8)
  x, h, w = (jnp.asarray(p[k]) for k in ("logits", "hidden", "weight"))
  labels, objective = jnp.asarray(p["labels"]), lambda lp, ent, a: -a * lp - 0.01 * ent
  adv = jnp.asarray(p["cot"][0])
  mesh = Mesh(np.array(devices(4)), ("v",))
  calls = {
      "logits": lambda k: jaxce.logprobs_and_entropy(x, labels, keep=k),
      "token_loss": lambda k: jaxce.token_loss(objective, x, labels, adv, keep=k)[1],
      "linear_token_loss": lambda k: jaxce.linear_token_loss(objective, h, w, labels, adv,
                                                             keep=k)[1],
      "shard_map": lambda k: jax.shard_map(  # (kept ids: every shard gets all of them)
          lambda w, k: jaxce.linear_logprobs_and_entropy(h, w, labels, keep=k, vocab_axis="v"),
          mesh=mesh, out_specs=P(), in_specs=(
              P(None, "v"), P() if isinstance(k, jaxce.keep.KeptIds) else P(None, "v")))(w, k),
      "sharded": lambda k: jaxce.sharded_linear_logprobs_and_entropy(
          h, w, labels, mesh=mesh, vocab_axis="v", keep=k),
  }
  for got, want in zip(calls[path](p["kept_ids"]), calls[path](p["keep"])):
    assert_close(got, want, 1e-10, path)


def test_the_planner_picks_kept_ids_by_their_number():
  """Every operation takes few kept ids as they are, many (or batch-invariant calls) as
  packed words, and says why."""
  p = _sparse_problem(13)
  x, h, w = (jnp.asarray(p[k]) for k in ("logits", "hidden", "weight"))
  adv, objective = p["cot"][0], lambda lp, ent, a: -a * lp
  calls = {
      "fused": lambda **k: jaxce.linear_logprobs_and_entropy(h, w, p["labels"], **k),
      "logits": lambda **k: jaxce.logprobs_and_entropy(x, p["labels"], **k),
      "token_loss": lambda **k: jaxce.token_loss(objective, x, p["labels"], adv, **k),
      "linear_token_loss": lambda **k: jaxce.linear_token_loss(objective, h, w, p["labels"],
                                                               adv, **k),
  }
  everything = _kept_ids(np.ones((T, V), bool), np.random.default_rng(0))
  for name, call in calls.items():
    small = jaxce.plan.of(call, keep=p["kept_ids"])
    assert small.kept_ids and "only their columns' logits" in small.reason, name
    many = jaxce.plan.of(call, keep=everything)
    assert not many.kept_ids and "cost less" in many.reason, name
    invariant = jaxce.plan.of(call, keep=p["kept_ids"], batch_invariant=True)
    assert not invariant.kept_ids and "exact sums" in invariant.reason, name


def test_the_planner_s_threshold_at_full_size(monkeypatch):
  """At T = 32768 over V = 151936 columns: a sampler's sets (8 ids a token) run over the
  kept columns only on both paths; top-k 128 sets still do, top-k 512 sets run the fused
  head whole but the logits path over its entries; top-k 2048 sets run whole on both."""
  monkeypatch.undo()
  tokens, columns, depth = 32768, 151936, 4096
  shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
  labels = shape(tokens, dtype=jnp.int32)
  calls = {"fused": (jaxce.linear_logprobs_and_entropy, shape(tokens, depth),
                     shape(depth, columns), labels),
           "logits": (jaxce.logprobs_and_entropy, shape(tokens, columns), labels)}
  expected = {8: dict(fused=True, logits=True), 128: dict(fused=True, logits=True),
              512: dict(fused=False, logits=True), 2048: dict(fused=False, logits=False)}
  for k, sparse in expected.items():
    kept = jaxce.keep.KeptIds(shape(k * tokens, dtype=jnp.int32),
                              shape(k * tokens, dtype=jnp.int32))
    for path, call in calls.items():
      plan = jaxce.plan.of(*call, keep=kept)
      assert plan.kept_ids == sparse[path], (k, path, plan.reason)
      if not sparse[path]:
        assert f"more than 1/{560 if path == 'fused' else 150} of the logits" in plan.reason


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_kept_ids_on_the_logits_path(chunk_size):
  """Only the kept entries of the logits read: against the float64 reference (values and
  gradients, the one-kept token's zeros, a label outside its set finite, no gradient
  outside the kept columns and the labels), per-token temperature, padded vocabulary."""
  p = _sparse_problem(15)
  options = dict(temperature=p["temperature"], where=p["where"], vocab_size=VOCAB)
  fn = lambda x: jaxce.logprobs_and_entropy(x, p["labels"], keep=p["kept_ids"],
                                            chunk_size=chunk_size, **options)
  ref = lambda x: reference.logprobs_and_entropy(x, p["labels"], keep=p["keep"], **options)
  x = jnp.asarray(p["logits"])
  assert jaxce.plan.of(fn, x).kept_ids
  (logp, entropy), (grad,) = _check(fn, ref, (x,), p["cot"], (0,))
  assert abs(float(logp[1])) < 1e-12 and abs(float(entropy[1])) < 1e-12
  touched = (p["mask"] | (np.arange(V) == p["labels"][:, None])) & p["where"][:, None]
  assert np.all(np.asarray(grad)[~touched] == 0)


@pytest.mark.parametrize("path", ["token_loss", "linear_token_loss"])
def test_kept_ids_on_the_objective_paths(path):
  """The objective over kept ids (the per-token kept-ids kernel under autodiff): loss and
  every gradient against the float64 reference on the same sets; a NaN token argument at
  ignored tokens reaches no gradient."""
  p = _sparse_problem(16)
  objective = lambda lp, ent, a: -a * jnp.exp(lp - jax.lax.stop_gradient(lp)) - 0.02 * ent
  adv = np.where(p["where"], p["cot"][0], np.nan)
  options = dict(temperature=p["temperature"], where=p["where"], vocab_size=VOCAB)
  valid = p["where"] & (p["labels"] >= 0)

  def reference_loss(*arrays):
    if path == "token_loss":
      logp, ent = reference.logprobs_and_entropy(*arrays, p["labels"], keep=p["keep"], **options)
    else:
      logp, ent = reference.linear_logprobs_and_entropy(*arrays, p["labels"], keep=p["keep"],
                                                        **options)
    return jnp.sum(jnp.where(valid, objective(logp, ent, jnp.where(valid, adv, 0)), 0))

  def loss(*arrays):
    fn = jaxce.token_loss if path == "token_loss" else jaxce.linear_token_loss
    return fn(objective, *arrays, p["labels"], adv, keep=p["kept_ids"], **options)[0]

  arrays = ((jnp.asarray(p["logits"]),) if path == "token_loss" else
            (jnp.asarray(p["hidden"]), jnp.asarray(p["weight"])))
  assert jaxce.plan.of(loss, *arrays).kept_ids
  argnums = tuple(range(len(arrays)))
  got = jax.jit(jax.value_and_grad(loss, argnums))(*arrays)
  want = jax.value_and_grad(reference_loss, argnums)(*arrays)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.all(np.isfinite(np.asarray(g)))
    assert_close(g, w, 1e-10, path)


@pytest.mark.parametrize("path,shards", [("logits", 1), ("logits", 2), ("linear", 4),
                                         ("linear", 8), ("token_loss", 2),
                                         ("linear_token_loss", 4)])
def test_kept_ids_sharded_equal_one_device(path, shards):
  """``sharded_*`` with kept ids (every shard gets them all and takes its columns' ones,
  several ids at the shards' edges): the one-device numbers, values and gradients."""
  tokens, columns = 8, 2048  # 256 columns a shard at 8 shards
  p = _problem(17, columns=columns, tokens=tokens)
  rng = np.random.default_rng(3)
  mask = rng.random((tokens, columns)) < 2 / columns
  edges = np.arange(0, columns, columns // 8)
  mask[:, edges] = mask[:, edges - 1] = True  # ids at every shard's first and last column
  mask[np.arange(tokens), p["labels"]] = True
  mask[1] = False
  mask[1, p["labels"][1]] = True  # one kept token: the label
  mask[2, p["labels"][2]] = False  # a label outside its kept set
  kept_ids = _kept_ids(mask, rng)
  mesh = Mesh(np.array(devices(shards)), ("v",))
  objective = lambda lp, ent, a: -a * lp - 0.01 * ent
  adv = p["cot"][0, :tokens]
  kw = dict(keep=kept_ids, temperature=p["temperature"][:tokens], vocab_size=columns - 8)
  cot = jnp.asarray(p["cot"][:, :tokens])
  x, h, w = (jnp.asarray(p[k]) for k in ("logits", "hidden", "weight"))
  labels = p["labels"]
  arrays = (x,) if path in ("logits", "token_loss") else (h, w)
  plain = {"logits": jaxce.logprobs_and_entropy, "linear": jaxce.linear_logprobs_and_entropy,
           "token_loss": jaxce.token_loss, "linear_token_loss": jaxce.linear_token_loss}[path]
  split = getattr(jaxce, f"sharded_{plain.__name__}")

  def loss(fn, *arrays, **sharded):
    """A scalar of the call's outputs: the objective's loss, or the per-token outputs
    weighted by random cotangents."""
    if "loss" in path:
      return fn(objective, *arrays, labels, adv, **kw, **sharded)[0]
    logp, entropy = fn(*arrays, labels, **kw, **sharded)
    return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * entropy)

  argnums = tuple(range(len(arrays)))
  one = jax.jit(jax.value_and_grad(lambda *a: loss(plain, *a), argnums))(*arrays)
  on_mesh = lambda *a: loss(split, *a, mesh=mesh, vocab_axis="v")
  got = jax.jit(jax.value_and_grad(on_mesh, argnums))(*arrays)
  assert jaxce.plan.of(on_mesh, *arrays).kept_ids
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(got)):
    assert_close(b, a, 1e-10, f"{path}, {shards} shards")


@pytest.mark.parametrize("path,shards", [("logits", 2), ("linear", 4), ("linear", 8)])
def test_sharded_equals_one_device(path, shards):
  """The words split with the vocabulary (256 columns: 32 per shard at 8 shards)."""
  p = _problem(5, columns=256, tokens=8)
  mesh = Mesh(np.array(devices(shards)), ("v",))
  kw = dict(keep=p["keep"], temperature=p["temperature"][:8], vocab_size=250)
  if path == "logits":
    arrays = (jnp.asarray(p["logits"]),)
    local = lambda x: jaxce.logprobs_and_entropy(x, p["labels"], **kw)
    sharded = lambda x: jaxce.sharded_logprobs_and_entropy(x, p["labels"], mesh=mesh,
                                                           vocab_axis="v", **kw)
  else:
    arrays = (jnp.asarray(p["hidden"]), jnp.asarray(p["weight"]))
    local = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, p["labels"], **kw)
    sharded = lambda h, w: jaxce.sharded_linear_logprobs_and_entropy(
        h, w, p["labels"], mesh=mesh, vocab_axis="v", **kw)
  argnums = tuple(range(len(arrays)))
  cot = jnp.asarray(p["cot"][:, :8])
  both = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(_weighted(f, cot), argnums)(*a)))
  for a, b in zip(jax.tree.leaves(both(local)(*arrays)), jax.tree.leaves(both(sharded)(*arrays))):
    assert_close(a, b, 1e-10, "outputs and grads")


def test_inside_shard_map_and_explicitly_split():
  p = _problem(6, columns=128, tokens=8)
  x, keep, labels = jnp.asarray(p["logits"]), p["keep"], jnp.asarray(p["labels"])
  want = jaxce.logprobs_and_entropy(x, labels, keep=keep)[0]
  mesh = Mesh(np.array(devices(4)), ("v",))
  inside = jax.shard_map(lambda x, k: jaxce.logprobs_and_entropy(x, labels, keep=k,
                                                                 vocab_axis="v")[0],
                         mesh=mesh, in_specs=(P(None, "v"), P(None, "v")), out_specs=P())
  assert_close(inside(x, keep), want, 1e-10, "inside shard_map")
  explicit = jax.make_mesh((4,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,),
                           devices=devices(4))
  with jax.set_mesh(explicit):
    split = lambda a: jax.device_put(a, NamedSharding(explicit, P(None, "v")))
    got = jaxce.logprobs_and_entropy(split(x), labels, keep=split(keep))[0]
  assert_close(got, want, 1e-10, "explicitly split")


@pytest.mark.parametrize("keep,error,message", [
    (lambda p: p["keep"].astype(jnp.int32), TypeError, "keep must be a uint32"),
    (lambda p: p["keep"][:, :-1], ValueError, r"keep must have shape .* \(13, 4\)"),
])
def test_bad_keep_is_an_error(keep, error, message):
  p = _problem()
  with pytest.raises(error, match=message):
    jaxce.logprobs_and_entropy(jnp.asarray(p["logits"]), p["labels"], keep=keep(p))


def test_a_split_vocabulary_needs_shards_of_32_columns():
  p = _problem(7, columns=96, tokens=4)
  mesh = Mesh(np.array(devices(2)), ("v",))
  with pytest.raises(ValueError, match="multiple of 32 columns, got 48"):
    jaxce.sharded_logprobs_and_entropy(jnp.asarray(p["logits"]), p["labels"], mesh=mesh,
                                       vocab_axis="v", keep=p["keep"])


def test_the_planner_keeps_kept_sets_on_the_kernels(monkeypatch):
  """On Hopper both paths' Mosaic kernels read the kept sets; the Triton one, asked for by
  name, says it cannot."""
  monkeypatch.setattr(jaxce.plan, "target", lambda *a, mesh=None: jaxce.plan.Target(
      "gpu", "9.0", 132))
  h = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
  labels, keep = jax.ShapeDtypeStruct((512,), jnp.int32), jax.ShapeDtypeStruct((512, 8),
                                                                              jnp.uint32)
  assert jaxce.plan.of(jaxce.linear_logprobs_and_entropy, h, w, labels).backend == "mosaic"
  assert jaxce.plan.of(jaxce.linear_logprobs_and_entropy, h, w, labels,
                       keep=keep).backend == "mosaic"
  logits = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="triton.*does not take a kept set"):
    jaxce.plan.of(jaxce.logprobs_and_entropy, logits, labels, keep=keep,
                  implementation="triton")
  # the logits path's kernel reads the kept sets with its tiles
  assert jaxce.plan.of(jaxce.logprobs_and_entropy, logits, labels, keep=keep).backend == \
      "mosaic"


def test_no_tokens_by_vocab_mask_in_the_compiled_plan():
  """The fused fwd+bwd with a kept set holds the packed words, never a [T, V] mask."""
  tokens, columns = 1024, 2048
  h = jnp.zeros((tokens, 64), jnp.float32)
  w = jnp.zeros((64, columns), jnp.float32)
  labels = jnp.zeros((tokens,), jnp.int32)
  keep = jnp.zeros((tokens, columns // 32), jnp.uint32)
  loss = lambda h, w: jnp.sum(jaxce.linear_logprobs_and_entropy(
      h, w, labels, keep=keep, chunk_size=128, vocab_block_size=256)[0])
  text = jax.jit(jax.grad(loss, (0, 1))).lower(h, w).compile().as_text()
  sizes = [np.prod([int(d) for d in dims.split(",")]) for dims in re.findall(r"\[([\d,]+)\]",
                                                                               text)]
  assert max(sizes) < tokens * columns // 4, max(sizes)


def test_kept_ids_hold_no_tokens_by_vocab_buffer():
  """XLA's compiled plans with kept ids: the fused objective's value and gradients, and
  the logits path's forward, hold no temporary near ``T x V`` (f32: 1/16 of it at most;
  the logits path's gradient is its output)."""
  tokens, columns, dim = 4096, 4096, 32
  kept = jaxce.keep.from_csr(jnp.arange(4 * tokens) % columns,
                             jnp.arange(tokens + 1) * 4)
  labels = jnp.zeros((tokens,), jnp.int32)
  objective = lambda lp, ent, a: -a * lp - 0.01 * ent
  h = jax.ShapeDtypeStruct((tokens, dim), jnp.float32)
  w = jax.ShapeDtypeStruct((dim, columns), jnp.float32)
  x = jax.ShapeDtypeStruct((tokens, columns), jnp.float32)
  adv = jnp.ones((tokens,))
  fused = jax.jit(jax.value_and_grad(lambda h, w: jaxce.linear_token_loss(
      objective, h, w, labels, adv, keep=kept)[0], (0, 1)))
  forward = jax.jit(lambda x: jaxce.logprobs_and_entropy(x, labels, keep=kept))
  for fn, args in ((fused, (h, w)), (forward, (x,))):
    assert jaxce.plan.of(fn, *args).kept_ids
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < 4 * tokens * columns // 16, temp


# --- the helpers against NumPy -------------------------------------------------------------

def test_pack_and_unpack():
  rng = np.random.default_rng(8)
  mask = rng.random((3, 4, 70)) < 0.5
  words = jaxce.keep.pack(mask)
  assert words.dtype == jnp.uint32 and words.shape == (3, 4, 3)
  expected = np.zeros((3, 4, 3), np.uint64)
  for v in range(70):
    expected[..., v // 32] |= mask[..., v].astype(np.uint64) << np.uint64(v % 32)
  np.testing.assert_array_equal(words, expected.astype(np.uint32))
  np.testing.assert_array_equal(jaxce.keep.unpack(words, 70), mask)


def test_from_top_k():
  ids = np.array([[3, 40, 3], [0, 69, 31]])
  got = np.asarray(jaxce.keep.unpack(jaxce.keep.from_top_k(ids, 70), 70))
  want = np.zeros((2, 70), bool)
  want[0, [3, 40]] = want[1, [0, 69, 31]] = True
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=r"ids\[\(1, 1\)\] = 70 is out of range for 70"):
    jaxce.keep.from_top_k(np.array([[1, 2], [3, 70]]), 70)


def _csr(rng, num_tokens, num_columns, spare=5):
  """vLLM-style kept ids: set sizes from prime-rl's spread (many singletons, a long tail,
  an empty set), a repeated id, a -1 pad and ids at word edges, then ``spare`` unused
  entries past ``offsets[-1]``; and the NumPy mask they mean."""
  sizes = rng.choice([0, 1, 1, 2, 3, 8, 40], size=num_tokens)
  mask = np.zeros((num_tokens, num_columns), bool)
  ids = []
  for t, size in enumerate(sizes):
    row = list(rng.integers(0, num_columns, size))
    if t % 3 == 1 and row:
      row += [row[0], -1, 31, 32, num_columns - 1]  # repeat, pad, word edges, last column
    mask[t, [v for v in row if v >= 0]] = True
    ids.append(row)
  offsets = np.concatenate([[0], np.cumsum([len(r) for r in ids])])
  flat = np.array(sum(ids, []) + list(rng.integers(0, num_columns, spare)), np.int32)
  return flat, offsets.astype(np.int32), mask


@pytest.mark.parametrize("num_tokens,num_columns", [(1, 33), (12, 70), (37, 1000)])
def test_from_csr_matches_numpy(num_tokens, num_columns):
  flat, offsets, mask = _csr(np.random.default_rng(num_tokens), num_tokens, num_columns)
  kept = jaxce.keep.from_csr(flat, offsets)
  ids, token = np.asarray(kept.ids), np.asarray(kept.token)
  assert np.all(np.diff(token) >= 0)  # sorted by token, then id, each kept id once
  used = ids >= 0
  pairs = list(zip(token[used], ids[used]))
  assert pairs == sorted(set(pairs)) == sorted(zip(*np.nonzero(mask)))
  got = jaxce.keep.pack_ids(kept, num_columns, shape=(num_tokens,))
  np.testing.assert_array_equal(got, jaxce.keep.pack(mask))
  jitted = jax.jit(lambda f, o: jaxce.keep.pack_ids(jaxce.keep.from_csr(f, o), num_columns,
                                                    shape=(num_tokens,)))(flat, offsets)
  np.testing.assert_array_equal(jitted, got)
  shard = jaxce.keep.pack_ids(kept, 32, shape=(num_tokens,), first_column=32)
  np.testing.assert_array_equal(shard, jaxce.keep.pack(mask[:, 32:64]))


def test_from_csr_with_the_buffer_exactly_full():
  """A sampler's fixed-capacity buffer filled to its last entry (``offsets[-1] ==
  len(token_ids)``): the last token keeps its last id, eagerly and under ``jit``; a token
  with no ids between two others keeps nothing."""
  token_ids = np.array([3, 7, 1, 4, 9, 30], np.int32)
  offsets = np.array([0, 2, 2, 6], np.int32)
  want = np.zeros((3, 40), bool)
  want[0, [3, 7]] = want[2, [1, 4, 9, 30]] = True
  convert = lambda f, o: jaxce.keep.pack_ids(jaxce.keep.from_csr(f, o), 40, shape=(3,))
  for fn in (convert, jax.jit(convert)):
    np.testing.assert_array_equal(fn(token_ids, offsets), jaxce.keep.pack(want))


def test_from_csr_without_ids():
  kept = jaxce.keep.from_csr(np.zeros(0, np.int32), np.zeros(3, np.int32))
  np.testing.assert_array_equal(jaxce.keep.pack_ids(kept, 40, shape=(2,)), np.zeros((2, 2)))


def test_from_csr_goes_into_keep():
  """vLLM's mask for a [2, 6] batch: the same log-probs as the boolean mask it means."""
  rng = np.random.default_rng(3)
  flat, offsets, mask = _csr(rng, 12, V)
  logits = adversarial_logits(rng, (2, 6, V), offset=-30.0)
  labels = np.where(mask.any(-1), mask.argmax(-1), 0).reshape(2, 6)
  keep = jaxce.keep.pack_ids(jaxce.keep.from_csr(flat, offsets), V, shape=(2, 6))
  assert keep.shape == (2, 6, -(-V // 32))
  got = jaxce.logprobs_and_entropy(logits, labels, keep=keep)
  want = jaxce.logprobs_and_entropy(logits, labels, keep=jaxce.keep.pack(mask.reshape(2, 6, V)))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g, w)
  kept = jaxce.keep.from_csr(flat, offsets)
  for g, w in zip(reference.logprobs_and_entropy(logits, labels, keep=kept), want):
    assert_close(g, w, 1e-10, "the reference takes kept ids")


@pytest.mark.parametrize("token_ids,offsets,message", [
    ([1, 2], [1, 2], "offsets must rise from 0"),
    ([1, 2], [0, 2, 1], "offsets must rise from 0"),
    ([1, 2], [0, 3], r"at most len\(token_ids\) = 2"),
])
def test_bad_csr_is_an_error(token_ids, offsets, message):
  with pytest.raises(ValueError, match=message):
    jaxce.keep.from_csr(np.array(token_ids), np.array(offsets))
  with pytest.raises(TypeError, match="offsets must be an integer array"):
    jaxce.keep.from_csr(np.array([1]), np.array([0.0, 1.0]))


def test_from_csr_holds_no_tokens_by_vocab_array():
  """The compiled conversion holds the words and ``[N]`` arrays: nothing ``[T, V]``."""
  tokens, columns, n = 2048, 8192, 16384
  lowered = jax.jit(lambda f, o: jaxce.keep.pack_ids(jaxce.keep.from_csr(f, o), columns,
                                                     shape=(tokens,))).lower(
      jnp.zeros(n, jnp.int32), jnp.zeros(tokens + 1, jnp.int32))
  text = lowered.compile().as_text()
  sizes = [np.prod([int(d) for d in dims.split(",")]) for dims in re.findall(r"\[([\d,]+)\]",
                                                                               text)]
  assert max(sizes) <= (tokens + 1) * columns // 32, max(sizes)


def _numpy_sampler_set(z, top_k, top_p, min_p):
  """What a sampler keeps (vLLM / HF order: top-k, then top-p, then min-p), in NumPy."""
  keep = np.ones_like(z, bool)
  for row, zr in enumerate(z):
    kept = np.ones(len(zr), bool)
    if top_k is not None:
      kept &= zr >= np.sort(zr)[::-1][top_k - 1]
    if top_p is not None:
      p = np.where(kept, np.exp(zr - zr[kept].max()), 0)
      p /= p.sum()
      order = np.argsort(-p, kind="stable")
      before = np.cumsum(p[order]) - p[order]
      chosen = order[before < top_p]
      kept &= p >= p[chosen].min()
    if min_p is not None:
      p = np.where(kept, np.exp(zr - zr[kept].max()), 0)
      kept &= p >= min_p
    keep[row] = kept
  return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, None, None), (None, 0.9, None),
                                               (None, None, 0.05), (20, 0.8, 0.01),
                                               (None, 1.0, None)])
def test_from_logits_matches_numpy(top_k, top_p, min_p):
  rng = np.random.default_rng(9)
  logits = rng.normal(size=(6, 70)) * 2
  got = jaxce.keep.unpack(jaxce.keep.from_logits(jnp.asarray(logits), temperature=0.7,
                                                 top_k=top_k, top_p=top_p, min_p=min_p), 70)
  np.testing.assert_array_equal(got, _numpy_sampler_set(logits / 0.7, top_k, top_p, min_p))
