"""Memory and cost from XLA's compiled plan (exact and deterministic on CPU)."""

import re

import jax
import jax.numpy as jnp
import pytest

from helpers import jaxce, reference

V, CHUNK = 4096, 64
TILE = CHUNK * V * 4  # one f32 [chunk, V] tile


def _compiled(f, *args, donate=()):
  return jax.jit(f, donate_argnums=donate).lower(*args).compile()


def _loss(fn, labels, adv, entropy_coef=0.01):
  def loss(*arrays):
    logp, entropy = fn(*arrays, labels)
    return jnp.sum(adv * logp) + entropy_coef * jnp.sum(entropy)
  return loss


def _inputs(tokens):
  return (jnp.zeros((tokens, V), jnp.float32), jnp.zeros((tokens,), jnp.int32),
          jnp.ones((tokens,), jnp.float32))


def _temp_bytes(fn, tokens, donate=()):
  x, labels, adv = _inputs(tokens)
  return _compiled(jax.grad(_loss(fn, labels, adv)), x, donate=donate).memory_analysis().temp_size_in_bytes


def _row_bytes(tokens):
  """Bytes per token the forward may hold beyond O(T) vectors of 64 bytes: on a Hopper
  GPU the Mosaic kernel's group statistics (16 bytes per group), written blocked by row
  block and then in token order."""
  x, labels, _ = _inputs(tokens)
  if jaxce.plan.of(jaxce.logprobs_and_entropy, x, labels).backend != "mosaic":
    return 0
  from jaxce._kernels.mosaic import rows as mosaic_rows  # pylint: disable=import-outside-toplevel
  from jaxce._kernels.mosaic import tile as mosaic_tile  # pylint: disable=import-outside-toplevel
  groups = mosaic_rows.num_groups(mosaic_tile.segments(V))
  return 2 * 16 * groups


def test_logits_path_temp_memory_is_flat_in_tokens():
  chunked = lambda x, l: jaxce.logprobs_and_entropy(x, l, chunk_size=CHUNK)
  small, large = _temp_bytes(chunked, 512), _temp_bytes(chunked, 4096)
  assert large <= small + 4096 * (64 + _row_bytes(4096)), (small, large)  # O(T) vectors
  assert large <= 3 * TILE, f"{large / TILE:.2f} tiles"
  ref_small, ref_large = _temp_bytes(reference.logprobs_and_entropy, 512), _temp_bytes(
      reference.logprobs_and_entropy, 4096)
  assert ref_large >= 7 * ref_small and ref_large >= 4096 * V * 4  # the reference grows with T


@pytest.mark.parametrize("tokens", [4096, 4100])  # chunk divides T; ragged last chunk
def test_donated_logits_take_the_gradient(tokens):
  """The backward writes the gradient into the dead logits' buffer: no second [T, V]. (On
  a Hopper GPU, with T not a multiple of 8 the Mosaic forward reads a padded copy of the
  logits, TMA's row tiling: that copy, and no more.)"""
  x, labels, adv = _inputs(tokens)
  fn = lambda x, l: jaxce.logprobs_and_entropy(x, l, chunk_size=CHUNK)
  plan = _compiled(jax.grad(_loss(fn, labels, adv)), x, donate=(0,)).memory_analysis()
  padded_copy = (-(-tokens // 8) * 8 * V * 4 if tokens % 8 and _row_bytes(tokens) else 0)
  assert plan.temp_size_in_bytes <= 3 * TILE + padded_copy, \
      f"{plan.temp_size_in_bytes / TILE:.2f} tiles"
  assert plan.alias_size_in_bytes == tokens * V * 4


def test_logits_as_intermediate_of_a_training_step():
  """model -> logits -> jaxce -> grads: the peak holds one [T, V] buffer, not two."""
  tokens, dim = 2048, 32
  h, labels, adv = (jnp.zeros((tokens, dim), jnp.float32), jnp.zeros((tokens,), jnp.int32),
                    jnp.ones((tokens,), jnp.float32))
  w = jnp.zeros((dim, V), jnp.float32)
  step = lambda fn: jax.grad(lambda w: _loss(fn, labels, adv)(h @ w))
  chunked = _compiled(step(lambda x, l: jaxce.logprobs_and_entropy(x, l, chunk_size=CHUNK)), w)
  plain = _compiled(step(reference.logprobs_and_entropy), w)
  logits_bytes = tokens * V * 4
  assert chunked.memory_analysis().temp_size_in_bytes <= logits_bytes + 3 * TILE
  assert plain.memory_analysis().temp_size_in_bytes >= 2 * logits_bytes


def test_unused_entropy_costs_no_backward_work():
  x, labels, adv = _inputs(512)
  f = lambda x: jaxce.logprobs_and_entropy(x, labels, chunk_size=CHUNK)
  flops = lambda g: _cost(_compiled(g, x))
  unused = flops(jax.grad(lambda x: jnp.sum(adv * f(x)[0])))
  stopped = flops(jax.grad(lambda x: (lambda o: jnp.sum(adv * o[0]) + jnp.sum(
      jax.lax.stop_gradient(o[1])))(f(x))))
  zero_cotangent = flops(jax.grad(lambda x: (lambda o: jnp.sum(adv * o[0]) + 0.0 * jnp.sum(o[1]))(f(x))))
  assert unused == stopped
  assert unused < 0.6 * zero_cotangent, (unused, zero_cotangent)


def test_fused_unused_entropy_costs_no_backward_work():
  """The fused path's symbolic zeros: with the entropy unused or under stop_gradient the
  compiled backward has fewer operations than with a real zero cotangent (``0.0 * ent``,
  which must do the entropy's per-element work). XLA's cost analysis of the compiled plan
  counts them (deterministic, not a timing); the matmuls are the same in all three."""
  tokens, dim, columns, chunk, block = 256, 32, 1024, 64, 256
  h, w = jnp.zeros((tokens, dim), jnp.float32), jnp.zeros((dim, columns), jnp.float32)
  labels, adv = jnp.zeros((tokens,), jnp.int32), jnp.ones((tokens,), jnp.float32)
  f = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels, chunk_size=chunk,
                                                     vocab_block_size=block)
  cost = lambda loss: _cost(_compiled(jax.grad(lambda h, w: loss(f(h, w)), (0, 1)), h, w))
  unused = cost(lambda o: jnp.sum(adv * o[0]))
  stopped = cost(lambda o: jnp.sum(adv * o[0]) + jnp.sum(jax.lax.stop_gradient(o[1])))
  zero_cotangent = cost(lambda o: jnp.sum(adv * o[0]) + 0.0 * jnp.sum(o[1]))
  assert unused == stopped, (unused, stopped)
  # The entropy term is several operations per element of a [chunk, block] tile (measured:
  # 7800048 against 8112818 flops + transcendentals, 19 per element); ask for one.
  assert zero_cotangent - unused >= chunk * block, (unused, zero_cotangent)


def _cost(compiled):
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return cost["flops"] + cost.get("transcendentals", 0)


def _largest_buffer_elements(hlo_text):
  sizes = [1]
  for dims in re.findall(r"\[([\d,]+)\]", hlo_text):
    n = 1
    for d in dims.split(","):
      n *= int(d)
    sizes.append(n)
  return max(sizes)


@pytest.mark.parametrize("layout", ["dv", "vd"])
def test_linear_path_never_holds_tokens_by_vocab(layout):
  dim, block, chunk = 64, 512, 128

  def plan(tokens):
    h, labels, adv = (jnp.zeros((tokens, dim), jnp.float32), jnp.zeros((tokens,), jnp.int32),
                      jnp.ones((tokens,), jnp.float32))
    w = jnp.zeros((dim, V) if layout == "dv" else (V, dim), jnp.float32)  # "vd": a tied embedding table
    fn = lambda h, w, l: jaxce.linear_logprobs_and_entropy(
        h, w, l, chunk_size=chunk, vocab_block_size=block, weight_layout=layout)
    return _compiled(jax.grad(_loss(fn, labels, adv), (0, 1)), h, w)

  small, large = plan(512), plan(4096)
  assert _largest_buffer_elements(large.as_text()) < 4096 * V // 8
  grow = large.memory_analysis().temp_size_in_bytes - small.memory_analysis().temp_size_in_bytes
  assert grow <= (4096 - 512) * (dim * 4 + 64), grow  # the f32 d-hidden accumulator + O(T)
  # Working set: two f32 tiles, the f32 [D, block] accumulator, the f32 [T, D] accumulator;
  # no copy of the weight or of its gradient (V * D * 4 bytes = 1 MiB here) in either layout.
  budget = 2 * chunk * block * 4 + dim * block * 4 + 4096 * dim * 4 + 4096 * 64
  assert large.memory_analysis().temp_size_in_bytes <= budget


def test_default_plan_bounds_cpu_memory():
  """XLA's CPU backend materializes f32 tiles: the default plan keeps them small there."""
  tokens, columns = 65536, 1024  # f32 [T, V] = 256 MiB
  x, labels = (jax.ShapeDtypeStruct((tokens, columns), jnp.float32),
               jax.ShapeDtypeStruct((tokens,), jnp.int32))
  plan = jax.jit(lambda x, l: jaxce.logprobs_and_entropy(x, l)).lower(x, labels).compile()
  assert plan.memory_analysis().temp_size_in_bytes <= 5 * jaxce.plan.LOGITS_TILE_BYTES["cpu"]


def test_linear_backward_memory_is_flat_in_tokens():
  """Past V_local tokens the fused backward sums d W (f32, like the weight) instead of
  d hidden (f32 [T, D]): its compiled working set stops growing with T but for O(T)
  vectors (labels, statistics, cotangents)."""
  dim, columns = 64, 512

  def plan(tokens):
    assert jaxce.plan.linear_backward_order(tokens, columns) == "token"
    h, labels, adv = (jnp.zeros((tokens, dim), jnp.float32), jnp.zeros((tokens,), jnp.int32),
                      jnp.ones((tokens,), jnp.float32))
    w = jnp.zeros((dim, columns), jnp.float32)
    fn = lambda h, w, l: jaxce.linear_logprobs_and_entropy(h, w, l, chunk_size=128,
                                                           vocab_block_size=256)
    return _compiled(jax.grad(_loss(fn, labels, adv), (0, 1)), h, w)

  small, large = plan(2048), plan(8192)
  grow = large.memory_analysis().temp_size_in_bytes - small.memory_analysis().temp_size_in_bytes
  assert grow <= (8192 - 2048) * 64, grow  # an f32 [T, D] sum would add 6144 * 256 bytes
