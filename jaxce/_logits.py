"""The logits path: chunked log-prob and entropy with a hand-written backward.

Public entry: :func:`logprobs_and_entropy` (re-exported by ``jaxce``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jaxce import _checks, _chunking, _math, _pallas


def logprobs_and_entropy(logits, labels, *, temperature=1.0, where=None, vocab_size=None,
                         chunk_size=None, vocab_axis=None, return_entropy=True,
                         implementation=None, backward_in_place=False):
  """Per-token log-probability of the label and entropy of softmax(logits / temperature).

  Args:
    logits: ``[..., V]`` bf16, f16 or f32 (``V = V_local``, this shard's columns, when
      ``vocab_axis`` is set).
    labels: int ``[...]``, global token ids. Negative ids are ignored.
    temperature: float > 0 or float array broadcastable to ``labels.shape``. No gradient.
    where: optional bool array broadcastable to ``labels.shape``; False positions are
      ignored. Ignored positions give log-prob 0, entropy 0 and an exactly zero gradient.
    vocab_size: logical vocabulary when the columns are padded; global column ids
      ``>= vocab_size`` are excluded from the softmax. A kept label ``>= vocab_size`` is a
      ``ValueError`` for concrete inputs and a NaN log-prob under ``jit``.
    chunk_size: tokens per step of the forward scan; ``None`` plans one (see
      ``jaxce._chunking.plan_chunk_size``); ``>= T`` runs a single pass.
    vocab_axis: mesh axis name (or tuple) the last dim is split over, when called inside
      ``shard_map`` / ``pmap``. Shard k holds ids ``[k * V_local, (k + 1) * V_local)``.
    return_entropy: when False the entropy is neither computed nor returned (``None``).
    implementation: forward statistics by ``"xla"`` (two fused passes per chunk of
      tokens) or ``"pallas"`` (one pass, a Triton kernel; interpreted off GPUs, for
      tests). ``None``: ``"pallas"`` on GPUs for bf16/f16/f32 logits (inside
      ``shard_map`` too), else ``"xla"``.
    backward_in_place: ``False`` (default): one fused pass writes the gradient; donated
      logits are reused by XLA, but as an intermediate of a jitted step XLA's GPU plan
      gives the gradient its own buffer. ``True``: the backward walks the logits in
      chunks of tokens and overwrites each chunk with its gradient, so when the logits
      are dead afterwards (donated, or an intermediate of a jitted training step) the
      gradient takes their buffer; when they are still alive XLA copies them first (one
      more read and write of the logits, no more memory). Measured on an H200 (T = 32768,
      V = 151936, bf16, bench/results/nvidia-h200-x1-4a285da.json): a training step's
      plan 10.7 GiB instead of two [T, V] buffers, but 19.4 vs 12.2 ms standalone (XLA
      splits the loop body in two fusions with a [chunk, V] bool temporary).

  Returns:
    ``(logp, entropy)``, float32 arrays of ``labels.shape`` (entropy ``None`` when
    ``return_entropy=False``).

  Memory: the forward keeps the logits plus three ``[T]`` vectors as residuals; its working
  set is O(T) with the Pallas kernel and the reductions' partial sums of one
  ``[chunk, V_local]`` tile (about 1% of it) with XLA. The backward reads the logits once
  and writes the gradient (an array like ``logits``) with no temporaries; see
  ``backward_in_place`` for when that array is the logits' own buffer.
  """
  logits = _checks.as_array("logits", logits)
  labels = _checks.as_array("labels", labels)
  if vocab_axis is None:  # arrays split over a mesh's explicit axes: the shard_map wrapper
    from jaxce import _sharded  # pylint: disable=import-outside-toplevel  (it wraps this)
    out = _sharded.split_like_their_types(logits, labels, dict(
        temperature=temperature, where=where, vocab_size=vocab_size, chunk_size=chunk_size,
        return_entropy=return_entropy, implementation=implementation,
        backward_in_place=backward_in_place))
    if out is not None:
      return out
  _checks.check_float("logits", logits)
  _checks.check_labels(labels, logits.shape[:-1], "logits.shape[:-1]")
  _checks.check_chunk_size(chunk_size)
  num_columns = logits.shape[-1]
  _checks.check_columns("logits", num_columns)
  shards = _checks.vocab_shards(vocab_axis)
  vocab_size = _checks.check_vocab_size(
      vocab_size, num_columns * shards,
      "logits" if shards == 1 else f"logits across {shards} shards of {vocab_axis!r}")
  inv_temp = _checks.inverse_temperature(temperature, labels.shape,
                                          _math.compute_dtype(logits.dtype))
  valid = _checks.valid_mask(labels, where)
  _checks.check_labels_in_range(labels, valid, vocab_size)

  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, _math.compute_dtype(logits.dtype))
    return zeros, (zeros if return_entropy else None)
  num_tokens = labels.size
  chunk = _chunking.plan_chunk_size(num_tokens, num_columns, chunk_size)
  implementation = _pallas.resolve_implementation(implementation, logits)
  mask_vocab = vocab_size if vocab_size < num_columns * shards else None
  out = _jitted_logprobs_entropy(
      logits.reshape(num_tokens, num_columns), labels.reshape(-1).astype(jnp.int32),
      inv_temp.reshape(-1), valid.reshape(-1), vocab_size, mask_vocab, chunk, vocab_axis,
      return_entropy, implementation, bool(backward_in_place))
  logp = out[0].reshape(labels.shape)
  entropy = out[1].reshape(labels.shape) if return_entropy else None
  return logp, entropy


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _logprobs_entropy(x, labels, inv_temp, valid, vocab_size, mask_vocab, chunk, vocab_axis,
                      with_entropy, implementation, in_place):
  """``x [T, V_local]`` -> ``(logp [T],)`` or ``(logp [T], entropy [T])``, float32."""
  out, _ = _forward(x, labels, inv_temp, valid, vocab_size, mask_vocab, chunk, vocab_axis,
                    with_entropy, implementation)
  return out


def _forward(x, labels, inv_temp, valid, vocab_size, mask_vocab, chunk, vocab_axis,
             with_entropy, implementation):
  num_tokens, num_columns = x.shape
  column_start = _math.shard_column_start(num_columns, vocab_axis)
  if implementation == "pallas":
    limit = num_columns if mask_vocab is None else jnp.clip(
        mask_vocab - column_start, 0, num_columns)
    m, s, q = _pallas.row_statistics(x, inv_temp, limit, with_entropy)
    picked = _math.label_logit(x, labels, inv_temp, column_start)
    m, s, q, picked = _math.combine_shards(m, s, q if with_entropy else None, picked, vocab_axis)
    log_s, entropy = _math.finish_statistics(s, q)
    logp, entropy_out = _math.finish_outputs((picked - m) - log_s, entropy, labels, valid,
                                             vocab_size)
    return (logp,) + ((entropy_out,) if with_entropy else ()), (m, log_s, entropy_out)

  def step(_, i):
    start = _chunking.chunk_start(i, num_tokens, chunk)
    rows = lambda a: lax.dynamic_slice_in_dim(a, start, chunk, 0)
    logp, m, log_s, entropy = _math.chunk_statistics(
        rows(x), rows(labels), rows(inv_temp), rows(valid), column_start, vocab_size,
        mask_vocab, vocab_axis, with_entropy)
    return None, (logp, m, log_s) + ((entropy,) if with_entropy else ())

  _, stacked = lax.scan(step, None, jnp.arange(_chunking.num_chunks(num_tokens, chunk)))
  logp, m, log_s, *entropy = (_chunking.unchunk(s, num_tokens) for s in stacked)
  # Residuals: m, log s and the entropy ([T] each; ignored rows get no gradient).
  return (logp,) + tuple(entropy), (m, log_s, entropy[0] if with_entropy else None)


def _logprobs_entropy_fwd(x, labels, inv_temp, valid, vocab_size, mask_vocab, chunk,
                          vocab_axis, with_entropy, implementation, in_place):
  x, labels, inv_temp, valid = (p.value for p in (x, labels, inv_temp, valid))
  out, stats = _forward(x, labels, inv_temp, valid, vocab_size, mask_vocab, chunk,
                        vocab_axis, with_entropy, implementation)
  return out, (x, labels, inv_temp, valid) + stats


def _logprobs_entropy_bwd(vocab_size, mask_vocab, chunk, vocab_axis, with_entropy,
                          implementation, in_place, residuals, cotangents):
  x, labels, inv_temp, valid, shift, log_sum, entropy = residuals
  g_logp = _math.symbolic_zero_to_none(cotangents[0])
  g_entropy = _math.symbolic_zero_to_none(cotangents[1]) if with_entropy else None
  if g_logp is None and g_entropy is None:
    return (jnp.zeros_like(x), None, None, None)
  column_start = _math.shard_column_start(x.shape[1], vocab_axis)

  def gradient(x, rows):
    """d loss / d logits of the logits rows ``x`` (``rows`` slices the [T] vectors)."""
    z = _math.scaled_logits(x, rows(inv_temp), column_start, mask_vocab)
    dz = _math.logit_grad(z, rows(labels) - column_start, rows(shift), rows(log_sum),
                          rows(entropy), rows(g_logp), rows(g_entropy), rows(valid))
    return (dz * rows(inv_temp)[:, None].astype(dz.dtype)).astype(x.dtype)

  if not in_place:
    # One elementwise pass over [T, V_local] into a new array.
    return (gradient(x, lambda a: a), None, None, None)

  # The logits buffer is the loop carry; each step overwrites one chunk of rows with
  # its gradient (XLA updates a loop carry in place, copying it first only when the
  # logits are still needed after the backward). A ragged tail is one static step.
  num_tokens = x.shape[0]
  full, tail = divmod(num_tokens, chunk)

  def overwrite(x, start, size):
    rows = lambda a: None if a is None else lax.dynamic_slice_in_dim(a, start, size, 0)
    return lax.dynamic_update_slice_in_dim(x, gradient(rows(x), rows), start, 0)

  x = lax.fori_loop(0, full, lambda i, x: overwrite(x, i * chunk, chunk), x)
  if tail:
    x = overwrite(x, full * chunk, tail)
  return (x, None, None, None)


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd, symbolic_zeros=True)
# Jitted once per static configuration, so repeated eager calls do not recompile; inside
# an outer jit (or shard_map) it is inlined.
_jitted_logprobs_entropy = jax.jit(_logprobs_entropy, static_argnums=(4, 5, 6, 7, 8, 9, 10))
