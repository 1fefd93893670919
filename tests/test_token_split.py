"""The token-split layout of sequence parallelism: hidden states split by tokens over the
devices that split the vocabulary (``batch_axis`` sharing axes with ``vocab_axis``), on
simulated devices against the float64 reference; and hidden states gathered inside a
user's own ``shard_map``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from helpers import assert_close, devices, jaxce, reference, value_and_grads


def _problem(seed, tokens=24, dim=8, num_columns=404, vocab_size=397):
  """A padded fused problem: hidden ``[tokens, dim]``, a weight of ``num_columns``
  columns, labels on every shard, per-token cotangents, a mask and temperatures."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(tokens, dim))
  weight = rng.normal(size=(dim, num_columns)) * 0.6
  labels = rng.integers(0, vocab_size, tokens)
  labels[:4] = (3, 101, 202, 396)  # (a label in each of 4 shards' columns)
  labels[5] = -100
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  kw = dict(vocab_size=vocab_size, where=rng.random(tokens) < 0.85,
            temperature=rng.uniform(0.5, 1.5, tokens), logit_softcap=5.0)
  return rng, hidden, weight, labels, loss_kw, kw


MESHES = [((4,), ("v",), "v", "v", "dv"),
          ((2, 4), ("data", "v"), ("data", "v"), "v", "dv"),
          ((2, 2), ("data", "v"), ("data", "v"), ("v",), "vd")]


def _as_sequences(leading, hidden, labels, *token_dicts):
  """The problem's tokens as ``leading`` dims (sequences of tokens, ``[B, S]``): hidden
  ``[B, S, D]``, every per-token array ``[B, S]``; the dicts' arrays reshaped in place."""
  for d in token_dicts:
    d.update({k: np.reshape(v, leading) for k, v in d.items() if np.ndim(v) == 1})
  return hidden.reshape(leading + hidden.shape[-1:]), labels.reshape(leading)


@pytest.mark.parametrize("shape,names,batch_axis,vocab_axis,layout,kept,leading",
                         [m + (False, None) for m in MESHES] + [MESHES[1] + (True, None)]
                         + [MESHES[1] + (False, (8, 3)), MESHES[0] + (False, (4, 6)),
                            MESHES[2] + (True, (4, 6))])
def test_token_split_matches_reference(shape, names, batch_axis, vocab_axis, layout, kept,
                                       leading):
  """Outputs, ``d hidden`` and ``d W`` of the token-split layout equal the unsharded
  float64 reference, with and without kept sets, with the tokens as sequences (``[B, S,
  D]`` hidden states split by sequence: each device's own rows are its sequences' tokens),
  and the outputs come back split like the tokens."""
  mesh = Mesh(np.array(devices(int(np.prod(shape)))).reshape(shape), names)
  rng, hidden, weight, labels, loss_kw, kw = _problem(len(shape), num_columns=512)
  if kept:
    sets = rng.random((labels.size, 512)) < 0.3
    sets[np.arange(labels.size), np.maximum(labels, 0)] = True
    kw["keep"] = np.asarray(jaxce.keep.pack(jnp.asarray(sets)))
  if leading:
    hidden, labels = _as_sequences(leading, hidden, labels, loss_kw, kw)
    if kept:
      kw["keep"] = kw["keep"].reshape(leading + kw["keep"].shape[-1:])
  stored = (lambda w: w) if layout == "dv" else (lambda w: w.T)
  f = lambda h, w, labels, **k: jaxce.sharded_linear_logprobs_and_entropy(
      h, stored(w), labels, mesh=mesh, vocab_axis=vocab_axis, batch_axis=batch_axis,
      weight_layout=layout, chunk_size=5, vocab_block_size=48, **k)
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  (logp, entropy), grads = jax.jit(lambda *a: value_and_grads(f, a, (0, 1), **loss_kw, **kw))(
      hidden, weight)
  (logp_ref, entropy_ref), grads_ref = value_and_grads(fr, (hidden, weight), (0, 1),
                                                       **loss_kw, **kw)
  assert_close(logp, logp_ref, 1e-10, "logp")
  assert_close(entropy, entropy_ref, 1e-10, "entropy")
  assert_close(grads[0], grads_ref[0], 1e-10, "d hidden")
  assert_close(grads[1], grads_ref[1], 1e-10, "d weight")
  logp = jax.jit(lambda h, w: f(h, w, labels, **kw))(hidden, weight)[0]
  assert logp.sharding.spec[0] == batch_axis, logp.sharding


@pytest.mark.parametrize("shape,names,batch_axis,vocab_axis,layout,leading",
                         [m + (None,) for m in MESHES[:2]] + [MESHES[1] + ((8, 3),)])
def test_token_split_objective_matches_reference(shape, names, batch_axis, vocab_axis, layout,
                                                 leading):
  """The fused objective path in the token-split layout: the loss (each token once) and
  its gradients equal the unsharded call's in float64, tokens as sequences too."""
  mesh = Mesh(np.array(devices(int(np.prod(shape)))).reshape(shape), names)
  rng, hidden, weight, labels, _, kw = _problem(10 + len(shape))
  if leading:
    hidden, labels = _as_sequences(leading, hidden, labels, kw)
  advantages = rng.normal(size=labels.shape)
  objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
  sharded = lambda h, w: jaxce.sharded_linear_token_loss(
      objective, h, w, labels, advantages, mesh=mesh, vocab_axis=vocab_axis,
      batch_axis=batch_axis, **kw)[0]
  plain = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, advantages,
                                               implementation="xla", **kw)[0]
  loss, grads = jax.jit(jax.value_and_grad(sharded, (0, 1)))(hidden, weight)
  loss_ref, grads_ref = jax.value_and_grad(plain, (0, 1))(hidden, weight)
  assert_close(loss, loss_ref, 1e-10, "loss")
  assert_close(grads[0], grads_ref[0], 1e-10, "d hidden")
  assert_close(grads[1], grads_ref[1], 1e-10, "d weight")


def test_token_split_reduce_scatters_d_hidden():
  """``d hidden`` goes back to the token split by a reduce-scatter: the compiled backward
  all-reduces no ``[T, D]`` array (the replicated layout's f32 sum is gone)."""
  mesh = Mesh(np.array(devices(4)), ("v",))
  _, hidden, weight, labels, loss_kw, kw = _problem(3, tokens=64, dim=16)
  f = lambda h, w, labels, **k: jaxce.sharded_linear_logprobs_and_entropy(
      h, w, labels, mesh=mesh, vocab_axis="v", batch_axis="v", **k)
  step = jax.jit(lambda *a: value_and_grads(f, a, (0, 1), **loss_kw, **kw)[1])
  text = step.lower(hidden, weight).compile().as_text()
  assert "reduce-scatter" in text
  all_reduces = [line for line in text.splitlines() if " all-reduce(" in line
                 or " all-reduce-start(" in line]
  assert not [line for line in all_reduces if "[64,16]" in line], all_reduces
  # (one all-gather of the hidden states, the forward's: the backward sums d hidden into
  # this device's own rows, with no all-gather of the sum as the replicated layout's)
  all_gathers = [line for line in text.splitlines() if ("all-gather(" in line
                                                        or "all-gather-start(" in line)
                 and "[64,16]" in line.split("=")[1].split("all-gather")[0]]
  assert len(all_gathers) == 1, all_gathers


def test_hidden_gathered_in_own_shard_map():
  """Hidden states gathered inside the caller's own ``shard_map`` (varying over the
  vocabulary axis) get their own shard's part of ``d hidden``, which the gather's
  transpose reduce-scatters: the gradient equals the unsharded one (it was 4 times too
  large on 4 shards when every shard summed the parts)."""
  mesh = Mesh(np.array(devices(4)), ("v",))
  _, hidden, weight, labels, loss_kw, kw = _problem(4, num_columns=400, vocab_size=400)
  del kw["where"]
  cot = np.stack([loss_kw["cot_logp"], loss_kw["cot_entropy"]])

  def body(h_own, w_own):
    h_all = jax.lax.all_gather(h_own, "v", axis=0, tiled=True)
    logp, entropy = jaxce.linear_logprobs_and_entropy(h_all, w_own, labels, vocab_axis="v",
                                                      **kw)
    return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * entropy)

  sharded = jax.shard_map(body, mesh=mesh, in_specs=(P("v"), P(None, "v")), out_specs=P())
  grads = jax.jit(jax.grad(sharded, (0, 1)))(hidden, weight)
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  _, grads_ref = value_and_grads(fr, (hidden, weight), (0, 1), **loss_kw, **kw)
  assert_close(grads[0], grads_ref[0], 1e-10, "d hidden")
  assert_close(grads[1], grads_ref[1], 1e-10, "d weight")


def test_token_split_errors():
  """A logits call cannot split its tokens over the vocabulary's axis, and the shared axes
  must be batch_axis's last: each is a ValueError that says so."""
  mesh = Mesh(np.array(devices(4)).reshape(2, 2), ("data", "v"))
  logits = jnp.zeros((8, 16))
  with pytest.raises(ValueError, match="token-split layout takes hidden states"):
    jaxce.sharded_logprobs_and_entropy(logits, jnp.zeros(8, jnp.int32), mesh=mesh,
                                       vocab_axis="v", batch_axis="v")
  with pytest.raises(ValueError, match="must be the last ones of batch_axis"):
    jaxce.sharded_linear_logprobs_and_entropy(
        jnp.zeros((8, 4)), jnp.zeros((4, 16)), jnp.zeros(8, jnp.int32), mesh=mesh,
        vocab_axis="v", batch_axis=("v", "data"))


def test_token_split_plan_holds_less_per_device():
  """XLA's compiled plan per device: the token-split layout's ``d hidden`` is its own
  tokens' rows (outputs smaller by ``(n - 1) / n`` of ``[T, D]``), and its arguments,
  outputs and temporaries together are less than the replicated layout's. On CPU its
  temporaries are also within 1 % of the replicated layout's (XLA:CPU's tiles dominate
  both); on a GPU the gathered ``[T, D]`` hidden states stand among the temporaries, where
  the replicated layout reads its argument, so there the total is what falls."""
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(devices(4)), ("v",))
  tokens, dim, columns = 1024, 256, 8192

  def plan(batch_axis):
    split = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype,
                                                            sharding=NamedSharding(mesh, spec))
    args = (split((tokens, dim), jnp.bfloat16, P(batch_axis)),
            split((dim, columns), jnp.bfloat16, P(None, "v")),
            split((tokens,), jnp.int32, P(batch_axis)))
    loss = lambda h, w, labels: sum(jnp.sum(o) for o in jaxce.sharded_linear_logprobs_and_entropy(
        h, w, labels, mesh=mesh, vocab_axis="v", batch_axis=batch_axis))
    return jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile().memory_analysis()

  replicated, token_split = plan(None), plan("v")
  hidden_rows = tokens * dim * 2 * 3 // 4  # (bf16 d hidden: the other 3 devices' rows)
  assert replicated.output_size_in_bytes - token_split.output_size_in_bytes == hidden_rows
  total = lambda p: (p.argument_size_in_bytes + p.output_size_in_bytes + p.temp_size_in_bytes
                     - p.alias_size_in_bytes)
  assert total(token_split) < total(replicated), (total(token_split), total(replicated))
  if jax.default_backend() == "cpu":
    assert token_split.temp_size_in_bytes <= replicated.temp_size_in_bytes * 1.01, (
        token_split.temp_size_in_bytes, replicated.temp_size_in_bytes)


def test_token_split_from_the_arrays_types():
  """On a mesh of explicit axes, plain calls on hidden states split by tokens over the
  weight's vocabulary axis take the token-split layout from the arrays' types: the
  outputs and ``d hidden`` come back split like the hidden states, and equal the
  unsharded call's."""
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  devices(4)
  mesh = jax.make_mesh((4,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:4])
  _, hidden, weight, labels, loss_kw, kw = _problem(6, num_columns=400, vocab_size=400)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(hidden, P("v")), put(weight, P(None, "v")))
  fn = lambda h, w, labels, **k: jaxce.linear_logprobs_and_entropy(h, w, labels, **k)
  with jax.set_mesh(mesh):
    (logp, _), grads = jax.jit(lambda *a: value_and_grads(
        fn, a, (0, 1), **{**loss_kw, "labels": put(labels, P("v"))}, **kw))(*args)
  assert logp.sharding.spec[0] == "v" and grads[0].sharding.spec[0] == "v"
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  (logp_ref, _), grads_ref = value_and_grads(fr, (hidden, weight), (0, 1), **loss_kw, **kw)
  assert_close(logp, logp_ref, 1e-10, "logp")
  assert_close(grads[0], grads_ref[0], 1e-10, "d hidden")
  assert_close(grads[1], grads_ref[1], 1e-10, "d weight")



def _bf16_problem(seed, tokens, dim, num_columns):
  """bf16 hidden ``[tokens, dim]`` and weight ``[dim, num_columns]`` (shifted, a few rows
  peaked), labels and per-token cotangents, made on the host."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(tokens, dim)) + 0.3
  weight = rng.normal(size=(dim, num_columns)) * 0.8
  weight[:, 7] += 3.0  # (a column most tokens favour: peaked rows)
  labels = rng.integers(0, num_columns, tokens)
  cot = rng.normal(size=(2, tokens))
  return (jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16), labels, cot,
          rng)


# (tokens, columns): fewer tokens than a shard's columns (the vocab-outer backward, one f32
# sum of d hidden over the blocks) and more (token-outer: each chunk's rows summed as it
# is written).
ORDERS = [pytest.param(48, 512, id="vocab-outer"), pytest.param(96, 128, id="token-outer")]


@pytest.mark.parametrize("tokens,columns", ORDERS)
@pytest.mark.parametrize("path,sequences", [("fused", None), ("kept-ids", None),
                                            ("objective", None), ("fused", 8),
                                            ("kept-ids", 8), ("objective", 8)])
def test_token_split_is_the_replicated_layouts_bits(path, sequences, tokens, columns):
  """The token-split layout sums ``d hidden`` over the vocabulary shards as the replicated
  layout does (in f32, rounded once to hidden's dtype), then keeps its own tokens' rows:
  outputs, ``d hidden`` and ``d W`` are the replicated call's bits, in bf16 on 4 shards,
  in both backward orders, on the fused, kept-ids and objective paths, and with the tokens
  as ``sequences`` (``[B, S, D]``, 2 sequences a device). (Before, the shards' parts were
  rounded to bf16 and then summed in bf16 by the gather's transpose; and a device's own
  rows of ``[B, S, D]`` were taken as ``B`` tokens, not ``B * S``.)"""
  mesh = Mesh(np.array(devices(4)), ("v",))
  hidden, weight, labels, cot, rng = _bf16_problem(7, tokens, 64, columns)
  if sequences:
    leading = (sequences, tokens // sequences)
    hidden, labels, cot = (hidden.reshape(leading + (64,)), labels.reshape(leading),
                           cot.reshape((2,) + leading))
  kw = dict(vocab_block_size=32, chunk_size=16) if path != "objective" else {}
  if path == "kept-ids":
    kw["keep"] = jaxce.keep.KeptIds(ids=jnp.asarray(rng.integers(0, columns, 40), jnp.int32),
                                    token=jnp.asarray(np.sort(rng.integers(0, tokens, 40)),
                                                      jnp.int32))

  def loss(batch_axis):
    if path == "objective":
      objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
      def f(h, w):
        value, (logp, entropy) = jaxce.sharded_linear_token_loss(
            objective, h, w, labels, cot[0], mesh=mesh, vocab_axis="v",
            batch_axis=batch_axis)
        return value, (logp, entropy)
    else:
      def f(h, w):
        logp, entropy = jaxce.sharded_linear_logprobs_and_entropy(
            h, w, labels, mesh=mesh, vocab_axis="v", batch_axis=batch_axis, **kw)
        return jnp.sum(cot[0] * logp.astype(jnp.float32)
                       + cot[1] * entropy.astype(jnp.float32)), (logp, entropy)
    return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(hidden, weight)

  (value, outputs), grads = loss(None)
  (split_value, split_outputs), split_grads = loss("v")
  for name, a, b in [("loss", value, split_value), ("logp", outputs[0], split_outputs[0]),
                     ("entropy", outputs[1], split_outputs[1]),
                     ("d hidden", grads[0], split_grads[0]), ("d W", grads[1], split_grads[1])]:
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)
