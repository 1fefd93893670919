"""Vocab-sharded == unsharded == reference, on 2, 4 and 8 simulated devices."""

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from helpers import adversarial_logits, assert_close, devices, jaxce, reference, value_and_grads


def _mesh(data, vocab):
  if len(jax.devices()) < data * vocab:  # CI's CPU run always has 8 simulated devices
    pytest.skip(f"needs {data * vocab} devices, {len(jax.devices())} present")
  devices = np.array(jax.devices()[: data * vocab]).reshape(data, vocab)
  return Mesh(devices, ("data", "vocab"))


def _labels_on_every_shard(rng, shape, vocab_size, shards):
  labels = rng.integers(0, vocab_size, shape)
  flat = labels.reshape(-1)
  per_shard = -(-vocab_size // shards)
  flat[:shards] = np.minimum(np.arange(shards) * per_shard + 1, vocab_size - 1)
  flat[shards] = -100
  return flat.reshape(shape)


@pytest.mark.parametrize("data,vocab", [(1, 2), (1, 4), (1, 8), (2, 4), (4, 2)])
def test_logits_path_sharded(data, vocab):
  rng = np.random.default_rng(data * 10 + vocab)
  shape, num_columns, vocab_size = (4, 9), 1016, 1001  # padded: 15 garbage columns
  logits = adversarial_logits(rng, shape + (num_columns,))
  logits[..., vocab_size:] = 50.0
  labels = _labels_on_every_shard(rng, shape, vocab_size, vocab)
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=shape), cot_entropy=rng.normal(size=shape))
  kw = dict(vocab_size=vocab_size, temperature=rng.uniform(0.5, 1.5, (4, 1)))
  x = jnp.asarray(logits, jnp.float32)
  sharded = lambda x, labels, **k: jaxce.sharded_logprobs_and_entropy(
      x, labels, mesh=_mesh(data, vocab), vocab_axis="vocab", batch_axis="data", chunk_size=5, **k)
  (lp, en), g = jax.jit(lambda x: value_and_grads(sharded, (x,), 0, **loss_kw, **kw))(x)
  (lp1, en1), g1 = value_and_grads(jaxce.logprobs_and_entropy, (x,), 0, chunk_size=5, **loss_kw, **kw)
  (lpr, enr), gr = value_and_grads(reference.logprobs_and_entropy, (jnp.asarray(logits),), 0,
                                   **loss_kw, **kw)
  for name, a, b, r in (("logp", lp, lp1, lpr), ("entropy", en, en1, enr), ("grad", g, g1, gr)):
    assert_close(a, b, 2e-5, f"{name} sharded vs unsharded")
    assert_close(a, r, 2e-4, f"{name} sharded vs reference")


@pytest.mark.parametrize("data,vocab,layout", [(1, 2, "dv"), (2, 4, "dv"), (1, 8, "dv"), (2, 2, "vd")])
def test_linear_path_sharded(data, vocab, layout):
  rng = np.random.default_rng(100 + data * 10 + vocab)
  shape, dim, num_columns, vocab_size = (4, 5), 12, 1016, 1003
  hidden = rng.normal(size=shape + (dim,))
  weight = rng.normal(size=(dim, num_columns)) * 0.6
  bias = rng.normal(size=num_columns)
  labels = _labels_on_every_shard(rng, shape, vocab_size, vocab)
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=shape), cot_entropy=rng.normal(size=shape))
  kw = dict(vocab_size=vocab_size, logit_softcap=4.0, where=rng.random(shape) < 0.9)
  stored = (lambda w: w) if layout == "dv" else (lambda w: w.T)
  f = lambda h, w, b, labels, **k: jaxce.sharded_linear_logprobs_and_entropy(
      h, stored(w), labels, bias=b, mesh=_mesh(data, vocab), vocab_axis="vocab", batch_axis="data",
      chunk_size=3, vocab_block_size=40, weight_layout=layout, **k)
  fr = lambda h, w, b, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  (lp, en), g = jax.jit(lambda *a: value_and_grads(f, a, (0, 1, 2), **loss_kw, **kw))(hidden, weight, bias)
  (lpr, enr), gr = value_and_grads(fr, (hidden, weight, bias), (0, 1, 2), **loss_kw, **kw)
  assert_close(lp, lpr, 1e-10, "logp")
  assert_close(en, enr, 1e-10, "entropy")
  for i in range(3):
    assert_close(g[i], gr[i], 1e-10, f"grad {i}")



def _mesh_2x2(axis_types):
  """A ("data", "vocab") 2 x 2 mesh with the given axis types."""
  if len(jax.devices()) < 4:
    pytest.skip(f"needs 4 devices, {len(jax.devices())} present")
  return jax.make_mesh((2, 2), ("data", "vocab"), axis_types=axis_types,
                       devices=jax.devices()[:4])


def _fused_problem(seed, temperature_shape):
  """A padded fused problem over 2 vocab shards, per-token cotangents, a mask and
  temperatures of ``temperature_shape``, and the float64 reference's outputs and grads."""
  rng = np.random.default_rng(seed)
  shape, dim, num_columns, vocab_size = (4, 3), 8, 402, 397
  hidden = rng.normal(size=shape + (dim,))
  weight = rng.normal(size=(dim, num_columns)) * 0.6
  labels = _labels_on_every_shard(rng, shape, vocab_size, 2)
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=shape), cot_entropy=rng.normal(size=shape))
  kw = dict(vocab_size=vocab_size, where=rng.random(shape) < 0.8,
            temperature=rng.uniform(0.5, 1.5, temperature_shape))
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  expected = value_and_grads(fr, (hidden, weight), (0, 1), **loss_kw, **kw)
  return hidden, weight, labels, loss_kw, kw, expected


@pytest.mark.parametrize("axis_types", ["explicit", "explicit_data"])
def test_explicit_mesh_takes_arrays_in_any_sharding(axis_types):
  """``jax.make_mesh``'s default axes are explicit: shard_map then takes only arrays split
  as its in_specs. The wrappers reshard every input themselves, the per-token ``where``
  and ``temperature`` they broadcast included, so unsharded arrays work, forward and
  backward, and give the reference's numbers."""
  explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
  mesh = _mesh_2x2((explicit, explicit) if axis_types == "explicit" else (explicit, auto))
  hidden, weight, labels, loss_kw, kw, ((lpr, enr), gr) = _fused_problem(11, (4, 3))
  common = dict(mesh=mesh, vocab_axis="vocab", batch_axis="data", chunk_size=5)
  fused = lambda h, w, labels, **k: jaxce.sharded_linear_logprobs_and_entropy(
      h, w, labels, vocab_block_size=64, **common, **k)
  on_logits = lambda h, w, labels, **k: jaxce.sharded_logprobs_and_entropy(
      h @ w, labels, **common, **k)
  for name, f in (("fused", fused), ("logits", on_logits)):
    with jax.set_mesh(mesh):  # explicit sharding's own rule for eager and jitted calls
      (lp, en), g = jax.jit(lambda *a: value_and_grads(f, a, (0, 1), **loss_kw, **kw))(
          hidden, weight)
      eager_lp, _ = f(hidden, weight, jnp.asarray(labels), **kw)
    assert_close(lp, lpr, 1e-10, f"{name} logp")
    assert_close(eager_lp, lpr, 1e-10, f"{name} eager logp")
    assert_close(en, enr, 1e-10, f"{name} entropy")
    for i in range(2):
      assert_close(g[i], gr[i], 1e-10, f"{name} grad {i}")


@pytest.mark.parametrize("layout", ["logits_data_vocab", "logits_data", "linear_data_vocab",
                                    "linear_d_split"])
def test_plain_functions_take_explicitly_split_arrays(layout):
  """Arrays whose types split them over explicit mesh axes (``jax.make_mesh`` + sharded
  ``device_put``, JAX's default): the plain functions run through the shard_map wrapper,
  the tokens split as the inputs' types say and the vocabulary over the axis that splits
  its dim (a split ``D`` is gathered). Before, XLA's explicit-sharding rules rejected the
  flattening of a split batch. Values and gradients against the reference; data
  parallelism alone compiles with no collective at all."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _mesh_2x2((jax.sharding.AxisType.Explicit,) * 2)
  hidden, weight, labels, loss_kw, kw, ((lpr, enr), gr) = _fused_problem(12, (4, 1))
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  split = dict(logits_data_vocab=("data", "vocab"), logits_data=("data", None),
               linear_data_vocab=(None, "vocab"), linear_d_split=("vocab", None))[layout]
  if layout.startswith("logits"):
    arrays = (put(hidden, "data"), put(weight, None, split[1]))
    f = lambda h, w, labels, **k: jaxce.logprobs_and_entropy(h @ w, labels, chunk_size=5, **k)
  else:
    arrays = (put(hidden, "data"), put(weight, *split))
    f = lambda h, w, labels, **k: jaxce.linear_logprobs_and_entropy(
        h, w, labels, chunk_size=5, vocab_block_size=64, **k)
  with jax.set_mesh(mesh):
    step = jax.jit(lambda *a: value_and_grads(f, a, (0, 1), **loss_kw, **kw))
    (lp, en), g = step(*arrays)
    eager_lp, _ = f(*arrays, put(labels, "data"), **kw)
    if layout == "logits_data":  # the gradient of logits split over the batch alone
      x, lab = put(hidden @ weight, "data"), put(labels, "data")
      compiled = jax.jit(jax.grad(lambda x: jnp.sum(jaxce.logprobs_and_entropy(
          x, lab, chunk_size=5)[0]))).lower(x).compile().as_text()
  assert_close(lp, lpr, 1e-10, "logp")
  assert_close(eager_lp, lpr, 1e-10, "eager logp")
  assert_close(en, enr, 1e-10, "entropy")
  for i in range(2):
    assert_close(g[i], gr[i], 1e-10, f"grad {i}")
    padded = lambda a: tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    assert padded(g[i]) == padded(arrays[i]), (i, g[i].sharding, arrays[i].sharding)
  if layout == "logits_data":
    assert not any(op in compiled for op in ("all-gather", "all-reduce", "all-to-all")), \
        "data parallelism alone needs no collective"


def test_eager_call_on_arrays_spanning_two_processes():
  """Global arrays whose shards live in two processes cannot be read on one host: the
  wrappers' value checks (labels in range, temperature > 0) leave them to the traced path
  instead of failing to fetch them. Two real processes, jax.distributed on localhost."""
  import socket
  import subprocess
  import sys
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  worker = [sys.executable, str(Path(__file__).with_name("two_process_worker.py"))]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      filter(None, (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")))))
  procs = [subprocess.Popen(worker + [str(i), port], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    logs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0 and f"process {i}: ok" in log, log[-3000:]


def test_pmap_vocab_axis():
  rng = np.random.default_rng(7)
  shards, tokens, local = min(4, len(jax.devices())), 6, 50
  logits = adversarial_logits(rng, (tokens, shards * local))
  labels = _labels_on_every_shard(rng, (tokens,), shards * local, shards)
  split = jnp.asarray(logits.reshape(tokens, shards, local).transpose(1, 0, 2))
  f = jax.pmap(lambda x, l: jaxce.logprobs_and_entropy(x, l, vocab_axis="v", chunk_size=4),
               axis_name="v", in_axes=(0, None))
  lp, en = f(split, labels)
  lpr, enr = reference.logprobs_and_entropy(logits, labels)
  for k in range(shards):
    assert_close(lp[k], lpr, 1e-10, "logp")
    assert_close(en[k], enr, 1e-10, "entropy")


@pytest.mark.parametrize("mapping", ["pmap", "shard_map_unchecked"])
def test_fused_path_without_varying_types(mapping):
  """The fused backward's ``d hidden`` is a partial sum on each vocab shard, all-reduced
  by the kernel itself. Inside ``shard_map`` with its type checks JAX sums it anyway (the
  replicated primal's cotangent), so a missing psum shows only under ``pmap`` and
  ``shard_map(check_vma=False)``, with the gradient taken inside the mapped function:
  values and all three gradients on every shard against the reference."""
  rng = np.random.default_rng(9)
  shards, tokens, dim, local = 2, 6, 8, 32
  devices(shards)
  hidden = rng.normal(size=(tokens, dim))
  weight = rng.normal(size=(dim, shards * local)) * 0.6
  bias = rng.normal(size=shards * local)
  labels = _labels_on_every_shard(rng, (tokens,), shards * local, shards)
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  f = lambda h, w, b, labels: jaxce.linear_logprobs_and_entropy(
      h, w, labels, bias=b, vocab_axis="vocab", chunk_size=4, vocab_block_size=12)

  def per_shard(h, w, b):
    (logp, entropy), (d_hidden, d_weight, d_bias) = value_and_grads(f, (h, w, b), (0, 1, 2),
                                                                    **loss_kw)
    return (logp, entropy, d_hidden), (d_weight, d_bias)

  if mapping == "pmap":
    split_weight = weight.reshape(dim, shards, local).transpose(1, 0, 2)
    replicated, (d_weight, d_bias) = jax.pmap(per_shard, axis_name="vocab", in_axes=(None, 0, 0))(
        hidden, split_weight, bias.reshape(shards, local))
    d_weight, d_bias = d_weight.transpose(1, 0, 2).reshape(dim, -1), d_bias.reshape(-1)
  else:  # each shard's copy of the replicated outputs, stacked along their first dim
    g = jax.shard_map(per_shard, mesh=_mesh(1, shards), check_vma=False,
                      in_specs=(P(), P(None, "vocab"), P("vocab")),
                      out_specs=((P("vocab"),) * 3, (P(None, "vocab"), P("vocab"))))
    replicated, (d_weight, d_bias) = jax.jit(g)(hidden, weight, bias)
    replicated = tuple(a.reshape((shards, tokens) + a.shape[1:]) for a in replicated)
  fr = lambda h, w, b, labels: reference.linear_logprobs_and_entropy(h, w, labels, bias=b)
  (lpr, enr), (dhr, dwr, dbr) = value_and_grads(fr, (hidden, weight, bias), (0, 1, 2), **loss_kw)
  for k in range(shards):
    for name, a, r in zip(("logp", "entropy", "d hidden"), replicated, (lpr, enr, dhr)):
      assert_close(a[k], r, 1e-10, f"{name} on shard {k}")
  assert_close(d_weight, dwr, 1e-10, "d weight")
  assert_close(d_bias, dbr, 1e-10, "d bias")


def test_collectives_are_rank_independent():
  """Each vocab shard runs the same collectives: the forward's (a pmax and a psum per
  chunk on XLA; an all-gather and a pmax with the kernels) and none in the backward of the
  logits path (its program lowered alone, the forward's residuals its arguments)."""
  mesh = _mesh(1, 4)
  x = jnp.zeros((8, 64), jnp.float32)
  labels = jnp.zeros((8,), jnp.int32)
  f = lambda x: jaxce.sharded_logprobs_and_entropy(x, labels, mesh=mesh, vocab_axis="vocab",
                                                   chunk_size=4)[0].sum()
  collectives = lambda hlo: sum(hlo.count(op) for op in ("all_reduce", "all-reduce",
                                                         "all_gather", "all-gather"))
  assert collectives(jax.jit(f).lower(x).as_text()) >= 1
  _, backward = jax.vjp(f, x)
  bwd_hlo = jax.jit(lambda backward, g: backward(g)).lower(backward, jnp.float32(1)).as_text()
  assert "stablehlo" in bwd_hlo and collectives(bwd_hlo) == 0


def _collectives(hlo):
  """``[(op, operand types, result type)]`` of the all-reduces, reduce-scatters and
  all-gathers of a lowered program's text (a reducing op's types follow its region)."""
  lines, found = hlo.splitlines(), []
  for i, line in enumerate(lines):
    op = next((o for o in ("all_reduce", "reduce_scatter", "all_gather")
               if f'"stablehlo.{o}"' in line), None)
    if op is None:
      continue
    end = i if op == "all_gather" else next(j for j in range(i, len(lines))
                                            if lines[j].lstrip().startswith("}) :"))
    operands, result = lines[end].rsplit(" : (", 1)[1].split(") -> ")
    found.append((op, operands, result.strip()))
  return found


@pytest.mark.parametrize("path", ["per_token", "objective"])
def test_d_hidden_is_reduce_scattered_in_f32_then_gathered(path):
  """``d hidden``'s sum over the vocab shards (hidden replicated over them): an f32
  reduce-scatter of the rows, then an all-gather in hidden's dtype (bf16) back to every
  row, and no f32 all-reduce of ``[rows, D]``: the f32 sum is rounded once, as the
  all-reduce's was, for a quarter less traffic. The gradients are the one-device call's up
  to the order of their f32 sums."""
  mesh, (tokens, dim, vocab) = _mesh(1, 4), (64, 32, 200)
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(dim, vocab)) * 0.3, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, tokens)), jnp.float32)

  def loss(sharded):
    kw = dict(mesh=mesh, vocab_axis="vocab") if sharded else {}
    if path == "objective":
      objective = lambda logp, entropy, c0, c1: c0 * logp + c1 * entropy
      fn = jaxce.sharded_linear_token_loss if sharded else jaxce.linear_token_loss
      return lambda h, w: fn(objective, h, w, labels, cot[0], cot[1], **kw)[0]
    fn = (jaxce.sharded_linear_logprobs_and_entropy if sharded
          else jaxce.linear_logprobs_and_entropy)
    return lambda h, w: sum(jnp.sum(c * o) for c, o in zip(cot, fn(h, w, labels, **kw)))

  grad = jax.jit(jax.grad(loss(True), (0, 1)))
  ops = _collectives(grad.lower(hidden, weight).as_text())
  scattered = [o for o in ops if o[0] == "reduce_scatter"]
  assert scattered and all(o[1].endswith(f"x{dim}xf32>") for o in scattered), ops
  rows = int(scattered[0][1].removeprefix("tensor<").split("x")[0])
  assert ("all_gather", f"tensor<{rows // 4}x{dim}xbf16>", f"tensor<{rows}x{dim}xbf16>") in ops
  assert not [o for o in ops if o[0] == "all_reduce" and f"x{dim}xf32>" in o[1]], ops
  for got, want in zip(grad(hidden, weight), jax.jit(jax.grad(loss(False), (0, 1)))(hidden,
                                                                                  weight)):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # (sums in another order: a bf16 value may round to its neighbour, at the gradient's
    # scale, as tests/test_properties.py allows two equally valid plans)
    assert np.max(np.abs(got - want)) <= 2.0**-7 * np.max(np.abs(want))


@pytest.mark.parametrize("mapping", ["pmap", "shard_map_unchecked"])
def test_bf16_d_hidden_without_varying_types(mapping):
  """Under ``pmap`` and ``shard_map(check_vma=False)`` a bf16 ``d hidden`` takes the
  reduce-scatter and all-gather too (every axis summed): each shard's is the one-device
  call's up to the order of its f32 sums."""
  shards, tokens, dim, local = 2, 16, 8, 32
  devices(shards)
  rng = np.random.default_rng(3)
  hidden = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(dim, shards * local)) * 0.6, jnp.bfloat16)
  labels = jnp.asarray(_labels_on_every_shard(rng, (tokens,), shards * local, shards))
  cot = jnp.asarray(rng.normal(size=(2, tokens)), jnp.float32)

  def d_hidden(h, w, **kw):
    loss = lambda h: sum(jnp.sum(c * o) for c, o in zip(
        cot, jaxce.linear_logprobs_and_entropy(h, w, labels, **kw)))
    return jax.grad(loss)(h)

  per_shard = functools.partial(d_hidden, vocab_axis="vocab")
  if mapping == "pmap":
    split = weight.reshape(dim, shards, local).transpose(1, 0, 2)
    got = jax.pmap(per_shard, axis_name="vocab", in_axes=(None, 0))(hidden, split)
  else:
    g = jax.shard_map(per_shard, mesh=_mesh(1, shards), check_vma=False,
                      in_specs=(P(), P(None, "vocab")), out_specs=P("vocab"))
    got = jax.jit(g)(hidden, weight).reshape(shards, tokens, dim)
  want = np.asarray(jax.jit(d_hidden)(hidden, weight), np.float64)
  for k in range(shards):
    error = np.max(np.abs(np.asarray(got[k], np.float64) - want))
    assert error <= 2.0**-7 * np.max(np.abs(want)), (k, error)
