"""The logits path's per-token kernel: log-prob and entropy of ``[T, V_local]`` logits rows
with a hand-written backward, on arrays the front door has checked and flattened.

Forward: ``logits_rows.forward`` (the row statistics of every token by the Mosaic GPU or
Triton kernel in one pass, or by XLA in a scan over chunks of tokens; shards combine them
with one pmax and one psum). Backward: one fused elementwise pass writes the gradient, or
(the plan's ``in_place``) the logits' buffer is overwritten: by the Mosaic GPU kernel
``mosaic_rows_grad`` (whose output aliases its input; ``"kernel"``), or by a loop chunk by
chunk (``"chunks"``). With a kept set on the Mosaic plan, the
gradient's pass is ``mosaic_rows_grad``'s kernel too (``logits_rows.gradient``).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import chunking, logits_rows, plumbing, softmax
from jaxce._kernels.mosaic import rows_grad as mosaic_rows_grad
from jaxce._kernels.config import Config, Tokens


def logprobs_entropy(x, tokens: Tokens, config: Config):
  """``x [T, V_local]`` and its ``tokens`` -> ``(logp [T],)`` or ``(logp, entropy)`` in the
  compute dtype; differentiable in ``x`` (jitted once per configuration, inlined inside an
  outer jit or shard_map).

  Memory: the forward keeps ``x`` and three ``[T]`` vectors as residuals; its working set
  is O(T) with the Mosaic or Triton kernel and the reductions' partial sums of one ``[chunk,
  V_local]`` tile with XLA. The backward reads ``x`` once and writes the gradient (an
  array like ``x``); with the plan's ``in_place`` it overwrites ``x``'s buffer when ``x``
  is dead.
  """
  return _jitted_logprobs_entropy(x, tokens, config=config)


@plumbing.custom_vjp("config")
def _logprobs_entropy(x, tokens, config):
  return logits_rows.forward(x, tokens, config)[0]


def _logprobs_entropy_fwd(x, tokens, config):
  x, tokens = plumbing.primal_values((x, tokens))
  out, saved = logits_rows.forward(x, tokens, config)
  return out, (x, tokens, saved)


def _logprobs_entropy_bwd(config, residuals, cotangents):
  x, tokens, saved = residuals
  mask_vocab, chunk, vocab_axis = config.plan.mask_vocab, config.plan.chunk, config.vocab_axis
  g_logp = plumbing.symbolic_zero_to_none(cotangents[0])
  g_entropy = plumbing.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  if g_logp is None and g_entropy is None:
    return (jnp.zeros_like(x), None)
  column_start = softmax.shard_column_start(x.shape[1], vocab_axis)
  per_token = (tokens, saved, (g_logp, g_entropy))

  if config.plan.in_place is None:
    # One elementwise pass over [T, V_local] into a new array.
    return (logits_rows.gradient(x, *per_token, mask_vocab, column_start, config), None)

  num_tokens = x.shape[0]

  def rows_gradient(x, start, size):
    return logits_rows.gradient(*chunking.take_rows((x,) + per_token, start, size),
                                mask_vocab, column_start)

  if config.plan.in_place == "kernel":
    limit = (None if mask_vocab is None else
             softmax.column_limit(mask_vocab, column_start, x.shape[1]))
    return (mosaic_rows_grad.overwrite(x, *per_token, column_start, limit, rows_gradient,
                                       layout=logits_rows.layout(x.shape[1], vocab_axis),
                                       interpret=config.plan.interpret), None)

  # The logits buffer is the loop carry; each step overwrites one chunk of rows with
  # its gradient (XLA updates a loop carry in place, copying it first only when the
  # logits are still needed after the backward). A ragged tail is one static step.
  full, tail = divmod(num_tokens, chunk)

  def overwrite(x, start, size):
    return lax.dynamic_update_slice_in_dim(x, rows_gradient(x, start, size), start, 0)

  x = lax.fori_loop(0, full, lambda i, x: overwrite(x, i * chunk, chunk), x)
  if tail:
    x = overwrite(x, full * chunk, tail)
  return (x, None)


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd, symbolic_zeros=True)
# Jitted once per static configuration, so repeated eager calls do not recompile; inside
# an outer jit (or shard_map) it is inlined.
_jitted_logprobs_entropy = jax.jit(_logprobs_entropy, static_argnames=("config",))
