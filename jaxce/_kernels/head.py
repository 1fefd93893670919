"""The LM head's tile, shared by the fused kernels: ``hidden @ weight`` in the operands'
common dtype with f32 accumulation, the bias and softcap on the way in, and the factors and
matmuls of the way back (``d logits`` to ``d hidden`` and ``d weight``). XLA ops only."""

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


def contract(a, b, a_dim, b_dim):
  """``a`` and ``b`` contracted over one dimension each, in their common dtype with f32
  (f64) accumulation."""
  operand_dtype, dtype = dtypes(a, b)
  return lax.dot_general(a.astype(operand_dtype), b.astype(operand_dtype),
                         (((a_dim,), (b_dim,)), ((), ())), preferred_element_type=dtype)


def tile_logits(hidden_rows, weight_cols, bias_cols, softcap, vocab_dim):
  """``[C, Vb]`` f32 logits of one tile (f32 accumulation)."""
  dtype = dtypes(hidden_rows, weight_cols)[1]
  x = contract(hidden_rows, weight_cols, 1, 1 - vocab_dim)
  if bias_cols is not None:
    x = x + bias_cols.astype(dtype)
  if softcap is not None:
    x = softcap * jnp.tanh(x / softcap)
  return x


def logits_input_grad(dz, inv_temp, x, softcap, keep):
  """``d loss / d (hidden @ W + bias)`` of a ``[C, Vb]`` tile from ``dz = d loss / d z``:
  the temperature's factor (``inv_temp [C]``) and, with a softcap, its derivative (``x``
  holds the capped logits); exactly 0 at rows where ``keep [C]`` is False, after every
  factor (an ignored row's NaN logits would otherwise come back as ``0 * NaN``)."""
  dx = dz * inv_temp[:, None].astype(dz.dtype)
  if softcap is not None:
    dx = dx * (1 - jnp.square(x / softcap))
  return jnp.where(keep[:, None], dx, 0)


def weight_grad(h, d, vocab_dim):
  """A tile's ``d W`` columns in the weight's layout: ``[D, Vb] = hᵀ d``, or
  ``[Vb, D] = dᵀ h`` (f32 accumulation)."""
  return contract(h, d, 0, 0) if vocab_dim else contract(d, h, 0, 0)
