"""The logits path's objective kernel: ``sum objective(logp, entropy, *token_args)`` of
``softmax(logits)`` and, under differentiation, its gradient, formed in the forward pass.

A loop over chunks of tokens reads a chunk's ``[C, V_local]`` rows for their statistics
(shards combine them with one pmax + one psum) and loss terms, and, when differentiating,
reads them again to form ``d logits`` from the cotangents the objective gives each token
and writes it over the same rows of the loop's buffer: two passes over the logits (read;
read + write) where a forward plus a backward need three. The buffer starts as the logits,
so when they are dead afterwards (donated, or an intermediate of a jitted step) the
gradient takes their memory; when they are still alive XLA copies them first. The
custom_vjp's backward only scales the stored gradient by the loss's cotangent.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxce import _math, _objective


class Config(NamedTuple):
  """The static configuration of one call (see ``_logits.Config`` for the shared fields).

  Attributes:
    chunk: tokens per loop step; a ragged tail runs as one more (static) step.
    with_entropy: the objective uses the entropy (else it is neither computed nor
      returned).
    pallas: the chunk's row statistics by the Pallas kernel (else XLA).
  """
  vocab_size: int
  mask_vocab: int | None
  chunk: int
  vocab_axis: object
  with_entropy: bool
  pallas: bool


def token_loss(objective, x, labels, inv_temp, valid, token_args, config: Config):
  """``x [T, V_local]``, ``labels`` int32 / ``inv_temp`` / ``valid`` bool / each of
  ``token_args`` ``[T]`` -> ``(loss, (logp [T], entropy [T] or None))``; the loss (this
  device's tokens) is differentiable in ``x``."""
  return _jitted(objective, x, labels, inv_temp, valid, tuple(token_args), config)


@partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _token_loss(objective, x, labels, inv_temp, valid, token_args, config):
  return _run(objective, x, labels, inv_temp, valid, token_args, config, with_grads=False)[0]


def _run(objective, x, labels, inv_temp, valid, token_args, config, with_grads):
  """``((loss, (logp, entropy)), (d x, type witness) or None)``: the gradient of this
  device's loss, not yet summed over shard_map axes."""
  num_tokens, num_columns = x.shape
  column_start = _math.shard_column_start(num_columns, config.vocab_axis)

  def chunk(buffer, start, size):
    rows = lambda a: lax.dynamic_slice_in_dim(a, start, size, 0)
    x_rows = rows(buffer)
    logp, shift, log_sum, entropy = _objective.statistics(
        x_rows, rows(labels), rows(inv_temp), rows(valid), column_start, config.vocab_size,
        config.mask_vocab, config.vocab_axis, config.with_entropy, config.pallas)
    loss, g_logp, g_entropy = _objective.terms_and_cotangents(
        objective, logp, entropy, [rows(a) for a in token_args], rows(valid), with_grads)
    outputs = (loss, logp) + ((entropy,) if config.with_entropy else ())
    if with_grads:
      z = _math.scaled_logits(x_rows, rows(inv_temp), column_start, config.mask_vocab)
      dz = _math.logit_grad(z, rows(labels) - column_start, shift, log_sum, entropy, g_logp,
                            g_entropy, rows(valid))
      dx = (dz * rows(inv_temp)[:, None].astype(dz.dtype)).astype(buffer.dtype)
      buffer = lax.dynamic_update_slice_in_dim(buffer, dx, start, 0)
    return buffer, outputs

  size = min(config.chunk, num_tokens)
  full, tail = divmod(num_tokens, size)
  buffer, stacked = lax.scan(lambda b, i: chunk(b, i * size, size), x, jnp.arange(full))
  loss, logp, *entropy = (stacked[0].sum(),) + tuple(s.reshape(-1) for s in stacked[1:])
  if tail:  # the ragged tail: one more step on its own rows
    buffer, (tail_loss, tail_logp, *tail_entropy) = chunk(buffer, full * size, tail)
    loss = loss + tail_loss
    logp = jnp.concatenate([logp, tail_logp])
    entropy = [jnp.concatenate([entropy[0], tail_entropy[0]])] if entropy else []
  out = (loss, (logp, entropy[0] if entropy else None))
  # A zero-size slice carries x's type over shard_map axes to the backward, which sums
  # the scaled gradient over the axes x does not vary over.
  return out, ((buffer, x.reshape(-1)[:0]) if with_grads else None)


def _fwd(objective, x, labels, inv_temp, valid, token_args, config):
  return _run(objective, x, labels, inv_temp, valid, token_args, config, with_grads=True)


def _bwd(objective, config, residuals, cotangents):
  del objective, config
  grad, witness = residuals
  scale = cotangents[0]  # the outputs (logp, entropy) are for metrics: no gradient
  return (_math.reduce_to_varying(grad * scale.astype(grad.dtype), witness), None, None, None,
          None)


_token_loss.defvjp(_fwd, _bwd)
_jitted = jax.jit(_token_loss, static_argnums=(0, 6))
