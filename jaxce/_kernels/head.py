"""The LM head's tile, shared by the fused kernels: ``hidden @ weight`` in the operands'
common dtype with f32 accumulation, the bias and softcap on the way in, and the factors and
matmuls of the way back (``d logits`` to ``d hidden`` and ``d weight``). XLA ops only.
Every matmul takes the plan's ``precision`` (``Plan.precision``, a ``jax.lax.Precision``
name; a name of none, such as an algorithm set in ``jax_default_matmul_precision``, leaves
it to JAX's setting)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxce._kernels import softmax


def dtypes(hidden, weight):
  """``(operand dtype, compute dtype)``: the matmuls take the inputs' common dtype, as
  ``hidden @ weight`` would, and accumulate (and compute the softmax) in f32 (f64 for
  f64 inputs)."""
  operand_dtype = jnp.promote_types(hidden.dtype, weight.dtype)
  return operand_dtype, softmax.compute_dtype(operand_dtype)


def precision_name(precision) -> str:
  """The lower-case name of the ``jax.lax.Precision`` that ``precision`` (a ``Precision``
  or a name ``jnp.dot`` takes: ``"highest"``, ``"float32"``, ...) is: the plan's form.
  Raises ``ValueError`` (or ``TypeError``) when it names none."""
  return lax.Precision(precision).name.lower()


def lax_precision(precision):
  """``jax.lax.Precision`` of the plan's ``precision`` name, or None (JAX's setting)."""
  try:
    return None if precision is None else lax.Precision(precision)
  except ValueError:
    return None


def contract(a, b, a_dim, b_dim, precision=None, out_dtype=None):
  """``a`` and ``b`` contracted over one dimension each, in their common dtype with f32
  (f64) accumulation, at ``precision`` (the plan's); the result in ``out_dtype`` (the
  accumulation's dtype unless given: the matmul rounds its sums into it once)."""
  operand_dtype, dtype = dtypes(a, b)
  return lax.dot_general(a.astype(operand_dtype), b.astype(operand_dtype),
                         (((a_dim,), (b_dim,)), ((), ())),
                         preferred_element_type=dtype if out_dtype is None else out_dtype,
                         precision=lax_precision(precision))


def tile_logits(hidden_rows, weight_cols, bias_cols, softcap, vocab_dim, precision=None):
  """``[C, Vb]`` f32 logits of one tile (f32 accumulation, at ``precision``)."""
  dtype = dtypes(hidden_rows, weight_cols)[1]
  x = contract(hidden_rows, weight_cols, 1, 1 - vocab_dim, precision)
  if bias_cols is not None:
    x = x + bias_cols.astype(dtype)
  return cap(x, softcap)


def cap(x, softcap):
  """``softcap * tanh(x / softcap)``, or ``x`` when ``softcap`` is None."""
  return x if softcap is None else softcap * jnp.tanh(x / softcap)


def pad_columns(array, width, dim):
  """``array`` zero-padded along ``dim`` to ``width`` (its last columns zeros)."""
  padding = [(0, 0)] * array.ndim
  padding[dim] = (0, width - array.shape[dim])
  return jnp.pad(array, padding)


def invariant_logits(hidden_rows, weight, bias, vocab_dim, block, precision=None):
  """``[C, V_local]`` f32 logits (before any softcap) of all of this shard's columns, by
  ``[C, D] @ [D, block]`` matmuls of one shape whatever ``V_local`` (a scan over the
  blocks; a ragged last block clamped back, a weight narrower than ``block`` padded with
  zero columns): each logit's
  bits then depend on its own row and column only (batch-invariant plans; ``C`` is the
  plan's ``matmul_tile[0]``). Memory: the f32 ``[C, V_local]`` result."""
  num_columns = weight.shape[vocab_dim]
  width = max(num_columns, block)
  if width > num_columns:
    weight = pad_columns(weight, width, vocab_dim)
    bias = None if bias is None else pad_columns(bias, width, 0)

  def write(out, j):
    col = jnp.minimum(j * block, width - block)
    cols = lambda a, dim: None if a is None else lax.dynamic_slice_in_dim(a, col, block, dim)
    tile = tile_logits(hidden_rows, cols(weight, vocab_dim), cols(bias, 0), None, vocab_dim,
                       precision)
    return lax.dynamic_update_slice_in_dim(out, tile, col, 1)

  # The first block is written outside the loop: the carry then has the operands' type
  # (varying over the mesh axes they vary over, inside shard_map).
  dtype = dtypes(hidden_rows, weight)[1]
  out = write(jnp.zeros((hidden_rows.shape[0], width), dtype), 0)
  out, _ = lax.scan(lambda out, j: (write(out, j), None), out,
                    jnp.arange(1, -(-width // block)))
  return out[:, :num_columns]


def logits_input_grad(dz, inv_temp, x, softcap, row_mask):
  """``d loss / d (hidden @ W + bias)`` of a ``[C, Vb]`` tile from ``dz = d loss / d z``:
  the temperature's factor (``inv_temp [C]``) and, with a softcap, its derivative (``x``
  holds the capped logits); exactly 0 at rows where ``row_mask [C]`` is False, after every
  factor (an ignored row's NaN logits would otherwise come back as ``0 * NaN``)."""
  dx = dz * inv_temp[:, None].astype(dz.dtype)
  if softcap is not None:
    dx = dx * (1 - jnp.square(x / softcap))
  return jnp.where(row_mask[:, None], dx, 0)


def weight_grad(h, d, vocab_dim, precision=None, out_dtype=None):
  """A tile's ``d W`` columns in the weight's layout: ``[D, Vb] = hᵀ d``, or
  ``[Vb, D] = dᵀ h`` (f32 accumulation, at ``precision``; in ``out_dtype`` when given,
  rounded once by the matmul)."""
  return (contract(h, d, 0, 0, precision, out_dtype) if vocab_dim else
          contract(d, h, 0, 0, precision, out_dtype))
