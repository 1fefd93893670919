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

import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import chunking, head, logits_rows, loss_terms, plumbing, softmax
from jaxce._kernels.config import Config, Tokens


def linear_token_loss(objective, hidden, weight, bias, tokens: Tokens, token_args,
                      config: Config):
  """``hidden [T, D]``, ``weight`` (``[D, V_local]`` or ``[V_local, D]``), ``bias``
  ``[V_local]`` or None, the ``tokens`` and ``token_args`` (each ``[T]``) -> ``(loss,
  (logp [T], entropy [T] or None))``; the loss (this device's tokens) is differentiable in
  ``hidden``, ``weight`` and ``bias``."""
  return _jitted(objective, hidden, weight, bias, tokens, tuple(token_args), config=config)


@plumbing.custom_vjp("objective", "config")
def _linear_token_loss(objective, hidden, weight, bias, tokens, token_args, config):
  return _run(objective, hidden, weight, bias, tokens, token_args, config,
              with_grads=False)[0]


def _run(objective, hidden, weight, bias, tokens, token_args, config, with_grads):
  """``((loss, (logp, entropy)), ((d hidden, d weight, d bias), type witnesses) or
  None)``: the gradients of this device's loss, not yet summed over shard_map axes."""
  num_tokens, num_columns = hidden.shape[0], weight.shape[config.vocab_dim]
  chunk, vocab_dim = config.plan.chunk, config.vocab_dim
  operand_dtype, dtype = head.dtypes(hidden, weight)
  column_start = softmax.shard_column_start(num_columns, config.vocab_axis)
  primals = (hidden, weight, bias)
  # (fewer tokens than a chunk: batch-invariant plans only, the matmul keeps its rows)
  hidden, tokens = chunking.pad_rows(hidden, chunk), tokens.padded(chunk)
  token_args = tuple(chunking.pad_rows(a, chunk) for a in token_args)
  padded = hidden.shape[0]

  def step(carry, i):
    start = chunking.chunk_start(i, padded, chunk)
    h, chunk_tokens, chunk_args = chunking.take_rows((hidden, tokens, token_args), start,
                                                     chunk)
    labels, inv_temp, valid, kept = chunk_tokens
    if not config.plan.exact_sums:
      x = head.tile_logits(h, weight, bias, config.softcap, vocab_dim)
    else:  # batch-invariant: matmuls of one shape (chunk = the tile's rows), no softcap yet
      x = head.invariant_logits(h, weight, bias, vocab_dim, config.plan.matmul_tile[1])
    logp, shift, log_sum, entropy = logits_rows.statistics(x, chunk_tokens, column_start, config)
    if config.plan.exact_sums:  # (the exact statistics applied it themselves)
      x = head.cap(x, config.softcap)
    row_mask = valid & chunking.fresh_rows(i, start, chunk)  # the overlap counts once
    loss, g_logp, g_entropy = loss_terms.terms_and_cotangents(
        objective, logp, entropy, list(chunk_args), row_mask, with_grads)
    outputs = (loss, logp) + ((entropy,) if config.with_entropy else ())
    if not with_grads:
      return carry, outputs
    d_hidden, d_weight, d_bias = carry
    kept_tile = None if kept is None else softmax.kept_columns(
        kept, 0, num_columns, labels - column_start)
    z = softmax.scaled_logits(x, inv_temp, column_start, config.mask_vocab, kept=kept_tile)
    dz = softmax.logit_grad(z, labels - column_start, shift, log_sum, entropy, g_logp,
                            g_entropy, row_mask)
    dx = head.logits_input_grad(dz, inv_temp, x, config.softcap, row_mask)
    d = dx.astype(operand_dtype)
    h = jnp.where(row_mask[:, None], h, 0)  # an ignored row's NaN must not reach d W as 0 * NaN
    dh_rows = head.contract(d, weight, 1, vocab_dim)
    if config.vocab_axis is not None:
      dh_rows = lax.psum(dh_rows, config.vocab_axis)  # partial sums over vocab shards
    fresh = chunking.fresh_rows(i, start, chunk)
    d_hidden = chunking.write_fresh(d_hidden, dh_rows, start, fresh)
    dw = head.weight_grad(h, d, vocab_dim)
    d_bias = None if d_bias is None else d_bias + jnp.sum(dx, axis=0)
    return (d_hidden, d_weight + dw, d_bias), outputs

  carry = None
  if with_grads:
    # d hidden's rows arrive summed over the vocab shards, so it varies like hidden; the
    # d weight and d bias sums vary like every input together (reduced at the end).
    d_weight, d_bias = plumbing.unify_varying(
        (jnp.zeros(weight.shape, dtype), None if bias is None else jnp.zeros(bias.shape, dtype),
         hidden, weight, *tokens[:3]), config.vocab_axis)[:2]
    carry = (jnp.zeros_like(hidden), d_weight, d_bias)
  n_chunks = chunking.num_chunks(padded, chunk)
  carry, (loss, logp, *entropy) = lax.scan(step, carry, jnp.arange(n_chunks))
  logp = chunking.unchunk(logp, padded)[:num_tokens]
  entropy = chunking.unchunk(entropy[0], padded)[:num_tokens] if entropy else None
  out = (jnp.sum(loss), (logp, entropy))
  if not with_grads:
    return out, None
  d_hidden, d_weight, d_bias = carry
  grads = (d_hidden[:num_tokens], d_weight.astype(primals[1].dtype),
           None if d_bias is None else d_bias.astype(primals[2].dtype))
  # Zero-size slices carry each primal's type over shard_map axes to the backward, which
  # sums the scaled gradients over the axes the primal does not vary over.
  witnesses = tuple(None if p is None else p.reshape(-1)[:0] for p in primals)
  return out, (grads, witnesses)


def _fwd(objective, hidden, weight, bias, tokens, token_args, config):
  return _run(objective, hidden, weight, bias, tokens, token_args, config, with_grads=True)


def _bwd(objective, config, residuals, cotangents):
  del objective, config
  grads, witnesses = residuals
  scale = cotangents[0]  # the outputs (logp, entropy) are for metrics: no gradient
  scaled = tuple(None if g is None else plumbing.reduce_to_varying(g * scale.astype(g.dtype), w)
                 for g, w in zip(grads, witnesses))
  return scaled + (None, None)


_linear_token_loss.defvjp(_fwd, _bwd)
_jitted = jax.jit(_linear_token_loss, static_argnames=("objective", "config"))
