"""Argument checks shared by the public functions. Every error names the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def is_concrete(*values) -> bool:
  """Whether every value can be read on this host now: no tracer, and no array with shards
  in another process (a multi-host global array: reading it is a collective, and an
  error raised by one process alone would leave the others waiting in the next one)."""
  return not any(isinstance(v, jax.core.Tracer)
                 or (isinstance(v, jax.Array) and not v.is_fully_addressable) for v in values)


def as_array(name: str, value):
  """``value`` as a jax array; anything that is not array-like is a TypeError naming it."""
  if (isinstance(value, (jax.Array, np.ndarray, np.generic, list, tuple, int, float, bool))
      or hasattr(value, "__jax_array__")):
    return jnp.asarray(value)
  raise TypeError(f"{name} must be an array, got {type(value).__name__}")


def check_float(name: str, x):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a float array (bf16, f16 or f32), got {x.dtype=}")
  if x.ndim < 1:
    raise ValueError(f"{name} must have at least 1 dimension, got {x.shape=}")


def check_labels(labels, leading_shape, leading_name: str):
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must be an integer array of token ids, got {labels.dtype=}")
  if labels.shape != tuple(leading_shape):
    raise ValueError(
        f"labels must have shape {leading_name} = {tuple(leading_shape)}, got {labels.shape=}")


def check_chunk_size(value, name="chunk_size"):
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be None or an int >= 1, got {name}={value!r}")


def check_columns(name, num_columns):
  if num_columns < 1:
    raise ValueError(f"{name} has no vocabulary columns (V = 0); expected V >= 1")


def broadcast_token_array(name: str, value, shape, dtype):
  """Broadcast ``where`` / ``temperature`` to the labels' shape, or say why not."""
  value = as_array(name, value)
  try:
    return jnp.broadcast_to(value, shape).astype(dtype)
  except ValueError:
    raise ValueError(
        f"{name} must be broadcastable to labels.shape={tuple(shape)}, got {value.shape=}"
    ) from None


def inverse_temperature(temperature, shape, dtype=jnp.float32):
  """``[*shape]`` 1/T in ``dtype`` (the compute dtype) with no gradient; concrete
  values must be > 0."""
  check_temperature(temperature)
  t = broadcast_token_array("temperature", as_array("temperature", temperature), shape, dtype)
  return lax.stop_gradient(1.0 / t)


def check_temperature(temperature):
  """Type, and > 0 wherever the value is known now (Python and numpy numbers too, which
  would turn into traced arrays under jit before a later check could see them)."""
  t = as_array("temperature", temperature) if not isinstance(temperature, jax.core.Tracer) \
      else temperature
  if not jnp.issubdtype(t.dtype, jnp.floating) and not jnp.issubdtype(t.dtype, jnp.integer):
    raise TypeError(f"temperature must be a float or float array, got {t.dtype=}")
  if is_concrete(temperature):
    host = np.asarray(temperature, np.float64)
    if host.size and not np.all(host > 0):
      raise ValueError(f"temperature must be > 0 everywhere, got min {host.min()}")


def valid_mask(labels, where):
  """``[*labels.shape]`` bool: positions that are not ignored."""
  valid = labels >= 0
  if where is not None:
    w = as_array("where", where)
    if w.dtype != jnp.bool_:
      raise TypeError(f"where must be a bool array, got {w.dtype=}")
    valid = valid & broadcast_token_array("where", w, labels.shape, jnp.bool_)
  return lax.stop_gradient(valid)


def vocab_shards(vocab_axis) -> int:
  """Number of shards along ``vocab_axis`` (1 when None); ValueError when unbound."""
  if vocab_axis is None:
    return 1
  try:
    return int(lax.psum(1, vocab_axis))
  except NameError:
    raise ValueError(
        f"vocab_axis={vocab_axis!r} is not bound: call inside jax.shard_map (or pmap) over "
        "a mesh with that axis, or use jaxce.sharded_logprobs_and_entropy") from None


def check_vocab_size(vocab_size, num_columns: int, columns_name: str) -> int:
  """Logical vocabulary (defaults to all columns)."""
  if vocab_size is None:
    return num_columns
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
    raise ValueError(f"vocab_size must be None or an int >= 1, got {vocab_size=!r}")
  if vocab_size > num_columns:
    raise ValueError(
        f"vocab_size={vocab_size} is larger than the {num_columns} columns of {columns_name}")
  return int(vocab_size)


def check_labels_in_range(labels, valid, vocab_size: int):
  """With concrete inputs, a label >= vocab_size at a kept position is a ValueError."""
  if not is_concrete(labels, valid):
    return
  bad = np.argwhere(np.asarray(valid) & (np.asarray(labels) >= vocab_size))
  if bad.size:
    position = tuple(int(i) for i in bad[0])
    raise ValueError(
        f"labels[{position}] = {int(np.asarray(labels)[position])} is out of range for "
        f"vocab_size={vocab_size} ({len(bad)} such position(s)); ignore a position with "
        "where=False or a negative label")
