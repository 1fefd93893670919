"""The logits path's per-token kernel: log-prob and entropy of ``[T, V_local]`` logits rows
with a hand-written backward, on arrays the front door has checked and flattened.

Forward: ``rows.forward`` (the row statistics of every token by the Triton kernel in one
pass, or by XLA in a scan over chunks of tokens; shards combine them with one pmax and one
psum). Backward: one fused elementwise pass writes the gradient, or (``config.in_place``)
a loop overwrites the logits chunk by chunk.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import plumbing, rows, softmax
from jaxce._kernels.config import Config


def logprobs_entropy(x, labels, inv_temp, valid, kept, config: Config):
  """``x [T, V_local]``, ``labels`` int32 ``[T]``, ``inv_temp [T]``, ``valid`` bool
  ``[T]``, ``kept`` uint32 ``[T, V_local / 32]`` (the kept sets) or None -> ``(logp [T],)``
  or ``(logp, entropy)`` in the compute dtype; differentiable in ``x`` (jitted once per
  configuration, inlined inside an outer jit or shard_map).

  Memory: the forward keeps ``x`` and three ``[T]`` vectors as residuals; its working set
  is O(T) with the Triton kernel and the reductions' partial sums of one ``[chunk,
  V_local]`` tile with XLA. The backward reads ``x`` once and writes the gradient (an
  array like ``x``); with ``in_place`` it overwrites ``x``'s buffer when ``x`` is dead.
  """
  return _jitted_logprobs_entropy(x, labels, inv_temp, valid, kept, config)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _logprobs_entropy(x, labels, inv_temp, valid, kept, config):
  return rows.forward(x, labels, inv_temp, valid, config, kept)[0]


def _logprobs_entropy_fwd(x, labels, inv_temp, valid, kept, config):
  x, labels, inv_temp, valid, kept = (
      None if p is None else p.value for p in (x, labels, inv_temp, valid, kept))
  out, stats = rows.forward(x, labels, inv_temp, valid, config, kept)
  return out, (x, labels, inv_temp, valid, kept) + stats


def _logprobs_entropy_bwd(config, residuals, cotangents):
  x, labels, inv_temp, valid, kept, shift, log_sum, entropy = residuals
  mask_vocab, chunk, vocab_axis = config.mask_vocab, config.plan.chunk, config.vocab_axis
  g_logp = plumbing.symbolic_zero_to_none(cotangents[0])
  g_entropy = plumbing.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  if g_logp is None and g_entropy is None:
    return (jnp.zeros_like(x), None, None, None, None)
  column_start = softmax.shard_column_start(x.shape[1], vocab_axis)
  gradient = lambda x, take: rows.gradient(
      x, take(labels), take(inv_temp), take(valid), take(shift), take(log_sum),
      take(entropy), take(g_logp), take(g_entropy), mask_vocab, column_start, take(kept))

  if not config.in_place:
    # One elementwise pass over [T, V_local] into a new array.
    return (gradient(x, lambda a: a), None, None, None, None)

  # The logits buffer is the loop carry; each step overwrites one chunk of rows with
  # its gradient (XLA updates a loop carry in place, copying it first only when the
  # logits are still needed after the backward). A ragged tail is one static step.
  num_tokens = x.shape[0]
  full, tail = divmod(num_tokens, chunk)

  def overwrite(x, start, size):
    take = lambda a: None if a is None else lax.dynamic_slice_in_dim(a, start, size, 0)
    return lax.dynamic_update_slice_in_dim(x, gradient(take(x), take), start, 0)

  x = lax.fori_loop(0, full, lambda i, x: overwrite(x, i * chunk, chunk), x)
  if tail:
    x = overwrite(x, full * chunk, tail)
  return (x, None, None, None, None)


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd, symbolic_zeros=True)
# Jitted once per static configuration, so repeated eager calls do not recompile; inside
# an outer jit (or shard_map) it is inlined.
_jitted_logprobs_entropy = jax.jit(_logprobs_entropy, static_argnums=(5,))
