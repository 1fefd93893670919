"""The fused LM-head path over kept ids: log-prob and entropy of the softmax renormalized
over each token's kept set ``S_t``, computing only the logits of ``S_t`` and the label.

With kept ids (``jaxce.keep.from_csr``) a token's outputs involve its kept columns alone:

    z_v = softcap(h_t · W[:, v] + b_v) / T_t   for v in S_t ∪ {y_t}
    logp = z_y - m - log s,  s = Σ_v exp(z_v - m),  H = log s - Σ_v exp(z_v - m)(z_v - m) / s

so the forward costs ``O((Σ_t |S_t| + T) · D)``, not ``O(T · V · D)``, and the gradient
reaches only those columns. The entries (a kept id and its token; the label of each
token is one more entry, and a kept id equal to its token's label is dropped, so the
label counts once, kept or not) are walked in blocks of ``BLOCK``: each block gathers
its hidden rows and weight columns (``[BLOCK, D]`` each) and forms its logits, f32
``[N]`` in all; the per-token statistics are segment reductions over them, combined over
the vocab shards (each shard owns the ids in its column range) with one pmax and one
psum. The backward forms each entry's ``d z`` from the saved statistics and accumulates
``d hidden`` (f32 ``[T, D]``), ``d weight`` and ``d bias`` (f32, like the weight) by
segment sums over the blocks.

Memory: the entries' f32 logits ``[N + T]``, two ``[BLOCK, D]`` gathers at a time; the
backward's f32 ``d hidden`` and ``d weight`` accumulators (the gradients' size in f32).
Nothing ``[T, V]``-sized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import head, plumbing, softmax
from jaxce._kernels.config import Config, KeptIds, Tokens

BLOCK = 4096  # entries per gather: two [BLOCK, D] operand-dtype arrays


def logprobs_entropy(hidden, weight, bias, tokens: Tokens, config: Config):
  """``hidden [T, D]``, ``weight`` (``[D, V_local]``, or ``[V_local, D]``), ``bias``
  ``[V_local]`` or None, and the ``tokens`` (``tokens.kept``: the kept ids, ``(ids,
  token)`` int32 ``[N]`` each, sorted by token, -1 ids unused) -> ``(logp [T],)`` or
  ``(logp, entropy)`` in the compute dtype; differentiable in ``hidden``, ``weight`` and
  ``bias``. Memory: see the module."""
  return _jitted(hidden, weight, bias, tokens, config=config)


def _entries(tokens, num_columns, config):
  """``(column, token, is_label, active)`` ``[N + T]`` each, padded to a multiple of
  ``BLOCK``: the local column of every kept id on this shard (dropping those equal to
  their token's label, those beyond the logical vocabulary and those of ignored tokens),
  then each token's label (on the shard that owns it)."""
  ids, token = tokens.kept
  num_tokens = tokens.labels.shape[0]
  shard_start = softmax.shard_column_start(num_columns, config.vocab_axis)
  limit = num_columns if config.mask_vocab is None else config.mask_vocab - shard_start
  safe_token = jnp.clip(token, 0, num_tokens - 1)
  column = ids - shard_start
  kept = ((ids >= 0) & (token >= 0) & (token < num_tokens) & (column >= 0)
          & (column < jnp.minimum(num_columns, limit)) & (ids != tokens.labels[safe_token])
          & tokens.valid[safe_token])
  label_column = tokens.labels - shard_start
  owns_label = tokens.valid & (label_column >= 0) & (label_column < num_columns)
  column = jnp.concatenate([jnp.where(kept, column, 0), jnp.where(owns_label, label_column, 0)])
  token = jnp.concatenate([safe_token, jnp.arange(num_tokens, dtype=safe_token.dtype)])
  is_label = jnp.concatenate([jnp.zeros_like(kept), jnp.ones_like(owns_label)])
  active = jnp.concatenate([kept, owns_label])
  size = -(-column.shape[0] // BLOCK) * BLOCK
  pad = lambda a: jnp.pad(a, (0, size - a.shape[0]))
  return pad(column), pad(token), pad(is_label), pad(active)


def _blocks(*arrays):
  """``[size]`` arrays as ``[size / BLOCK, BLOCK]`` (for a scan over blocks)."""
  return tuple(a.reshape(-1, BLOCK) for a in arrays)


def _weight_columns(weight, column, vocab_dim):
  """``[BLOCK, D]``: the weight's columns ``column`` (either layout)."""
  if vocab_dim == 0:
    return jnp.take(weight, column, axis=0, mode="clip")
  return jnp.take(weight, column, axis=1, mode="clip").T


def _logits(hidden, weight, bias, tokens, entries, config):
  """``(z, x)``, f32 ``[size]`` each: every entry's scaled logit ``z`` (``-inf``-free:
  inactive entries hold 0) and its capped logit ``x`` before the temperature."""
  column, token, _, active = entries
  operand_dtype, dtype = head.dtypes(hidden, weight)

  def block(_, arrays):
    column, token = arrays
    h = jnp.take(hidden, token, axis=0).astype(operand_dtype)
    w = _weight_columns(weight, column, config.vocab_dim).astype(operand_dtype)
    x = jnp.einsum("nd,nd->n", h, w, preferred_element_type=dtype)
    if bias is not None:
      x = x + jnp.take(bias, column, mode="clip").astype(dtype)
    return None, head.cap(x, config.softcap)

  _, x = lax.scan(block, None, _blocks(column, token))
  x = x.reshape(-1)
  z = jnp.where(active, x * tokens.inv_temp[token].astype(dtype), 0)
  return z, x


def _statistics(z, entries, num_tokens, config):
  """``(m, log s, entropy or None, picked)`` ``[T]`` over every shard's entries."""
  _, token, is_label, active = entries
  floor = jnp.finfo(z.dtype).min
  m = jax.ops.segment_max(jnp.where(active, z, floor), token, num_tokens)
  m = jnp.maximum(m, floor)  # (a token with no entry here: finfo.min, never -inf)
  shifted = z - m[token]
  e = jnp.where(active, jnp.exp(shifted), 0)
  s = jax.ops.segment_sum(e, token, num_tokens)
  q = (jax.ops.segment_sum(e * jnp.where(active, shifted, 0), token, num_tokens)
       if config.with_entropy else None)
  picked = jax.ops.segment_sum(jnp.where(is_label & active, z, 0), token, num_tokens)
  m, s, q, picked = softmax.combine_shards(m, s, q, picked, config.vocab_axis)
  log_s, entropy = softmax.finish_statistics(jnp.where(s > 0, s, 1), q)
  return m, log_s, entropy, picked


def _forward(hidden, weight, bias, tokens, config):
  num_tokens = hidden.shape[0]
  outer = tokens
  hidden, weight, bias, *arrays = plumbing.unify_varying(
      (hidden, weight, bias, tokens.labels, tokens.inv_temp, tokens.valid, *tokens.kept),
      config.vocab_axis)
  tokens = Tokens(*arrays[:3], KeptIds(*arrays[3:]))
  entries = _entries(tokens, weight.shape[config.vocab_dim], config)
  z, _ = _logits(hidden, weight, bias, tokens, entries, config)
  m, log_s, entropy, picked = _statistics(z, entries, num_tokens, config)
  logp, entropy_out = softmax.finish_outputs((picked - m) - log_s, entropy, outer.labels,
                                             outer.valid, config.vocab_size)
  out = (logp,) + ((entropy_out,) if config.with_entropy else ())
  return out, (m, log_s, entropy)


@plumbing.custom_vjp("config")
def _kept_ids_logprobs_entropy(hidden, weight, bias, tokens, config):
  return _forward(hidden, weight, bias, tokens, config)[0]


def _fwd(hidden, weight, bias, tokens, config):
  hidden, weight, bias, tokens = plumbing.primal_values((hidden, weight, bias, tokens))
  out, saved = _forward(hidden, weight, bias, tokens, config)
  return out, (hidden, weight, bias, tokens, saved)


def _bwd(config, residuals, cotangents):
  hidden, weight, bias, tokens, (m, log_s, entropy) = residuals
  g_logp = plumbing.symbolic_zero_to_none(cotangents[0])
  g_entropy = plumbing.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  zeros = (jnp.zeros_like(hidden), jnp.zeros_like(weight),
           None if bias is None else jnp.zeros_like(bias), None)
  if g_logp is None and g_entropy is None:
    return zeros
  witnesses = (hidden, weight, bias)
  saved = (m, log_s) + (() if entropy is None else (entropy,))
  hidden, weight, bias, *arrays = plumbing.unify_varying(
      (hidden, weight, bias, tokens.labels, tokens.inv_temp, tokens.valid, *tokens.kept,
       *saved), config.vocab_axis)
  tokens = Tokens(*arrays[:3], KeptIds(*arrays[3:5]))
  m, log_s, *rest = arrays[5:]
  entropy = rest[0] if rest else None
  num_columns = weight.shape[config.vocab_dim]
  entries = _entries(tokens, num_columns, config)
  column, token, is_label, active = entries
  z, x = _logits(hidden, weight, bias, tokens, entries, config)
  dtype = z.dtype
  log_p = z - m[token] - log_s[token]
  p = jnp.exp(log_p)
  dz = jnp.zeros_like(z)
  if g_logp is not None:
    dz = dz + g_logp[token].astype(dtype) * (is_label.astype(dtype) - p)
  if g_entropy is not None:
    dz = dz - g_entropy[token].astype(dtype) * p * (log_p + entropy[token])
  valid = active & tokens.valid[token]
  dx = head.logits_input_grad(dz[:, None], tokens.inv_temp[token], x[:, None], config.softcap,
                              valid)[:, 0]

  def block(carry, arrays):
    d_hidden, d_weight = carry
    column, token, dx = arrays
    h = jnp.take(hidden, token, axis=0).astype(dtype)
    w = _weight_columns(weight, column, config.vocab_dim).astype(dtype)
    d_hidden = d_hidden.at[token].add(dx[:, None] * w)
    update = dx[:, None] * h
    d_weight = (d_weight.at[column].add(update) if config.vocab_dim == 0
                else d_weight.at[:, column].add(update.T))
    return (d_hidden, d_weight), None

  start = (jnp.zeros(hidden.shape, dtype), jnp.zeros(weight.shape, dtype))
  (d_hidden, d_weight), _ = lax.scan(block, start, _blocks(column, token, dx))
  if config.vocab_axis is not None:
    d_hidden = lax.psum(d_hidden, config.vocab_axis)
  d_bias = None if bias is None else jax.ops.segment_sum(dx, column, num_columns)
  grads = (d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype),
           None if bias is None else d_bias.astype(bias.dtype))
  return tuple(None if g is None else plumbing.reduce_to_varying(g, w)
               for g, w in zip(grads, witnesses)) + (None,)


_kept_ids_logprobs_entropy.defvjp(_fwd, _bwd, symbolic_zeros=True)
_jitted = jax.jit(_kept_ids_logprobs_entropy, static_argnames=("config",))
