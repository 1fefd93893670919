"""The fused path's objective kernel: ``sum objective(logp, entropy, *token_args)`` of
``softmax(hidden @ weight)`` and, under differentiation, its gradients, formed in the
forward pass with three matmuls.

One scan over chunks of tokens (token-outer). Per chunk: ``x = hidden_chunk @ weight``,
the chunk's full ``[C, V_local]`` rows in f32 (matmul 1), kept until the chunk is done;
its statistics (shards combine them with one pmax + one psum) and per-token loss terms;
then, when differentiating, the cotangents the objective gives each token, ``d logits``
of the rows, ``d hidden_chunk = d @ weightᵀ`` (matmul 2, all-reduced over the vocab axis
in f32 and written once) and ``d weight += hidden_chunkᵀ @ d`` (matmul 3) into an f32
``[D, V_local]`` accumulator. The custom_vjp's backward only scales the stored gradients
by the loss's cotangent. Extra memory: the gradients, the f32 ``d weight`` accumulator and
one chunk's rows (f32 and the operand-dtype ``d``), flat in T beyond ``d hidden``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxce import _chunking, _linear, _math, _objective


class Config(NamedTuple):
  """The static configuration of one call (see ``_linear.Config`` for the shared fields).

  Attributes:
    chunk: tokens per scan step (their full vocabulary rows are held at once).
    with_entropy: compute (and return) the entropy: the objective uses it, or the caller
      asked for it.
  """
  vocab_size: int
  mask_vocab: int | None
  chunk: int
  vocab_axis: object
  softcap: float | None
  with_entropy: bool
  vocab_dim: int
  pallas: bool


def linear_token_loss(objective, hidden, weight, bias, labels, inv_temp, valid, token_args,
                      config: Config):
  """``hidden [T, D]``, ``weight`` (``[D, V_local]`` or ``[V_local, D]``), ``bias``
  ``[V_local]`` or None, ``labels`` int32 / ``inv_temp`` / ``valid`` bool / each of
  ``token_args`` ``[T]`` -> ``(loss, (logp [T], entropy [T] or None))``; the loss (this
  device's tokens) is differentiable in ``hidden``, ``weight`` and ``bias``."""
  return _jitted(objective, hidden, weight, bias, labels, inv_temp, valid, tuple(token_args),
                 config)


@partial(jax.custom_vjp, nondiff_argnums=(0, 8))
def _linear_token_loss(objective, hidden, weight, bias, labels, inv_temp, valid, token_args,
                       config):
  return _run(objective, hidden, weight, bias, labels, inv_temp, valid, token_args, config,
              with_grads=False)[0]


def _run(objective, hidden, weight, bias, labels, inv_temp, valid, token_args, config,
         with_grads):
  """``((loss, (logp, entropy)), ((d hidden, d weight, d bias), type witnesses) or
  None)``: the gradients of this device's loss, not yet summed over shard_map axes."""
  num_tokens, num_columns = hidden.shape[0], weight.shape[config.vocab_dim]
  chunk, vocab_dim = config.chunk, config.vocab_dim
  operand_dtype, dtype = _linear.dtypes(hidden, weight)
  column_start = _math.shard_column_start(num_columns, config.vocab_axis)
  primals = (hidden, weight, bias)

  def step(carry, i):
    start = _chunking.chunk_start(i, num_tokens, chunk)
    rows = lambda a: None if a is None else lax.dynamic_slice_in_dim(a, start, chunk, 0)
    h = rows(hidden)
    x = _linear.tile_logits(h, weight, bias, config.softcap, vocab_dim)
    logp, shift, log_sum, entropy = _objective.statistics(
        x, rows(labels), rows(inv_temp), rows(valid), column_start, config.vocab_size,
        config.mask_vocab, config.vocab_axis, config.with_entropy, config.pallas)
    keep = rows(valid) & _chunking.fresh_rows(i, start, chunk)  # the overlap counts once
    loss, g_logp, g_entropy = _objective.terms_and_cotangents(
        objective, logp, entropy, [rows(a) for a in token_args], keep, with_grads)
    outputs = (loss, logp) + ((entropy,) if config.with_entropy else ())
    if not with_grads:
      return carry, outputs
    d_hidden, d_weight, d_bias = carry
    z = _math.scaled_logits(x, rows(inv_temp), column_start, config.mask_vocab)
    dz = _math.logit_grad(z, rows(labels) - column_start, shift, log_sum, entropy, g_logp,
                          g_entropy, keep)
    dx = _linear.logits_input_grad(dz, rows(inv_temp), x, config.softcap, keep)
    d = dx.astype(operand_dtype)
    h = jnp.where(keep[:, None], h, 0)  # an ignored row's NaN must not reach d W as 0 * NaN
    dh_rows = _linear.contract(d, weight, 1, vocab_dim)
    if config.vocab_axis is not None:
      dh_rows = lax.psum(dh_rows, config.vocab_axis)  # partial sums over vocab shards
    fresh = _chunking.fresh_rows(i, start, chunk)[:, None]
    d_hidden = lax.dynamic_update_slice_in_dim(
        d_hidden, jnp.where(fresh, dh_rows.astype(d_hidden.dtype), rows(d_hidden)), start, 0)
    dw = _linear.weight_grad(h, d, vocab_dim)
    d_bias = None if d_bias is None else d_bias + jnp.sum(dx, axis=0)
    return (d_hidden, d_weight + dw, d_bias), outputs

  carry = None
  if with_grads:
    # d hidden's rows arrive summed over the vocab shards, so it varies like hidden; the
    # d weight and d bias sums vary like every input together (reduced at the end).
    d_weight, d_bias = _math.unify_varying(
        (jnp.zeros(weight.shape, dtype), None if bias is None else jnp.zeros(bias.shape, dtype),
         hidden, weight, labels, inv_temp, valid), config.vocab_axis)[:2]
    carry = (jnp.zeros_like(hidden), d_weight, d_bias)
  n_chunks = _chunking.num_chunks(num_tokens, chunk)
  carry, (loss, logp, *entropy) = lax.scan(step, carry, jnp.arange(n_chunks))
  logp = _chunking.unchunk(logp, num_tokens)
  entropy = _chunking.unchunk(entropy[0], num_tokens) if entropy else None
  out = (jnp.sum(loss), (logp, entropy))
  if not with_grads:
    return out, None
  d_hidden, d_weight, d_bias = carry
  grads = (d_hidden, d_weight.astype(primals[1].dtype),
           None if d_bias is None else d_bias.astype(primals[2].dtype))
  # Zero-size slices carry each primal's type over shard_map axes to the backward, which
  # sums the scaled gradients over the axes the primal does not vary over.
  witnesses = tuple(None if p is None else p.reshape(-1)[:0] for p in primals)
  return out, (grads, witnesses)


def _fwd(objective, hidden, weight, bias, labels, inv_temp, valid, token_args, config):
  out, grads = _run(objective, hidden, weight, bias, labels, inv_temp, valid, token_args,
                    config, with_grads=True)
  return out, grads


def _bwd(objective, config, residuals, cotangents):
  del objective, config
  grads, witnesses = residuals
  scale = cotangents[0]  # the outputs (logp, entropy) are for metrics: no gradient
  scaled = tuple(None if g is None else _math.reduce_to_varying(g * scale.astype(g.dtype), w)
                 for g, w in zip(grads, witnesses))
  return scaled + (None, None, None, None)


_linear_token_loss.defvjp(_fwd, _bwd)
_jitted = jax.jit(_linear_token_loss, static_argnums=(0, 8))
