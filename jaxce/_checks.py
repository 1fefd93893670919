"""Argument checks of the front door, and the normalizations that follow them.

``check_*`` raise (every error names the argument, its shape or value, and what was
expected); the front door calls each once per call, on the arrays the user passed. The
normalizations (``inverse_temperature``, ``valid_mask``, ``vocab_dim``) raise nothing and
run where the arrays are used: on this device, or on each shard inside ``shard_map``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxce._kernels import head, plumbing
from jaxce._kernels.config import KeptIds


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


def check_size(value, name):
  """``chunk_size`` / ``vocab_block_size``: None or an int >= 1."""
  if value is None:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be None or an int >= 1, got {name}={value!r}")


def check_columns(name, num_columns):
  if num_columns < 1:
    raise ValueError(f"{name} has no vocabulary columns (V = 0); expected V >= 1")


def check_flag(name, value):
  """A Python bool (or NumPy bool): ``name`` is a static option, not an array."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False, got {value!r}")


def check_choice(name, value, choices):
  if value not in choices:
    expected = " or ".join(repr(c) for c in choices)
    raise ValueError(f"{name} must be {expected}, got {name}={value!r}")


def check_broadcastable(name, value, shape):
  """``value`` (an array) broadcasts to the labels' ``shape``."""
  try:
    fits = jnp.broadcast_shapes(value.shape, tuple(shape)) == tuple(shape)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(
        f"{name} must be broadcastable to labels.shape={tuple(shape)}, got {value.shape=}")


def check_temperature(temperature, shape):
  """Type, shape, and > 0 wherever the value is known now (Python and numpy numbers too,
  which would turn into traced arrays under jit before a later check could see them)."""
  t = temperature if isinstance(temperature, jax.core.Tracer) else as_array(
      "temperature", temperature)
  if not jnp.issubdtype(t.dtype, jnp.floating) and not jnp.issubdtype(t.dtype, jnp.integer):
    raise TypeError(f"temperature must be a float or float array, got {t.dtype=}")
  check_broadcastable("temperature", t, shape)
  if is_concrete(temperature):
    host = np.asarray(temperature, np.float64)
    if host.size and not np.all(host > 0):
      raise ValueError(f"temperature must be > 0 everywhere, got min {host.min()}")


def check_where(where, shape):
  if where is None:
    return
  w = as_array("where", where)
  if w.dtype != jnp.bool_:
    raise TypeError(f"where must be a bool array, got {w.dtype=}")
  check_broadcastable("where", w, shape)


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
  if (isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer))
      or vocab_size < 1):
    raise ValueError(f"vocab_size must be None or an int >= 1, got {vocab_size=!r}")
  if vocab_size > num_columns:
    raise ValueError(
        f"vocab_size={vocab_size} is larger than the {num_columns} columns of {columns_name}")
  return int(vocab_size)


def check_labels_in_range(labels, where, vocab_size: int):
  """With concrete inputs, a label >= vocab_size at a kept position is a ValueError."""
  if not is_concrete(labels, where):
    return
  labels = np.asarray(labels)
  valid = labels >= 0
  if where is not None:
    valid = valid & np.broadcast_to(np.asarray(where), labels.shape)
  bad = np.argwhere(valid & (labels >= vocab_size))
  if bad.size:
    position = tuple(int(i) for i in bad[0])
    raise ValueError(
        f"labels[{position}] = {int(labels[position])} is out of range for "
        f"vocab_size={vocab_size} ({len(bad)} such position(s)); ignore a position with "
        "where=False or a negative label")


def check_keep(keep, shape, num_columns, shards, local):
  """``keep``: kept ids (``KeptIds``: int ``[N]`` ids and tokens), or uint32 ``[*labels.
  shape, W]``, the kept sets packed 32 columns a word. ``num_columns``: the columns of
  the array passed (this shard's when ``local``, inside ``shard_map``; else all of them,
  split over ``shards``). A split vocabulary splits the words with it, so each shard's
  columns must be a multiple of 32."""
  if isinstance(keep, KeptIds):
    ids, token = as_array("keep.ids", keep.ids), as_array("keep.token", keep.token)
    if (ids.ndim != 1 or ids.shape != token.shape
        or not all(jnp.issubdtype(a.dtype, jnp.integer) for a in (ids, token))):
      raise ValueError(f"keep: kept ids must be two integer [N] arrays (jaxce.keep.from_csr), "
                       f"got {ids.shape}, {token.shape}")
    return
  keep = as_array("keep", keep)
  if keep.dtype != jnp.uint32:
    raise TypeError(f"keep must be a uint32 array of packed bits (jaxce.keep.pack), got "
                    f"{keep.dtype=}")
  per_shard = num_columns if local else num_columns // shards
  if shards > 1 and per_shard % 32:
    raise ValueError(f"keep splits with the vocabulary, 32 columns a word: each of the {shards} "
                     f"shards must hold a multiple of 32 columns, got {per_shard}")
  words = -(-num_columns // 32)
  if keep.shape != (*shape, words):
    raise ValueError(f"keep must have shape labels.shape + (ceil(V / 32),) = {(*shape, words)}"
                     f" for V = {num_columns} columns{' on this shard' if local else ''}, got "
                     f"{keep.shape=}")


def check_weight(hidden, weight, weight_layout):
  """The fused path's weight: ``[D, V]`` (``"dv"``) or ``[V, D]`` (``"vd"``)."""
  check_choice("weight_layout", weight_layout, ("dv", "vd"))
  dim = vocab_dim(weight_layout)
  if weight.ndim != 2 or weight.shape[1 - dim] != hidden.shape[-1]:
    expected = "[D, V]" if dim else "[V, D]"
    raise ValueError(f"weight must have shape {expected} (weight_layout={weight_layout!r}) with "
                     f"D = hidden.shape[-1] = {hidden.shape[-1]}, got {weight.shape=}")


def check_bias(bias, num_columns):
  """``bias`` as an array of shape ``[V]`` (or None)."""
  if bias is None:
    return None
  bias = as_array("bias", bias)
  check_float("bias", bias)
  if bias.shape != (num_columns,):
    raise ValueError(f"bias must have shape [V] = ({num_columns},), got {bias.shape=}")
  return bias


def check_precision(precision):
  """``precision`` (``None``, a ``jax.lax.Precision`` or a name it takes, as ``jnp.dot``'s
  argument) as the name of a ``jax.lax.Precision``, or None."""
  if precision is None:
    return None
  try:
    return head.precision_name(precision)
  except (ValueError, TypeError):
    raise ValueError(
        "precision must be None (JAX's jax_default_matmul_precision), a jax.lax.Precision or "
        "one of 'default', 'high', 'highest' (or 'bfloat16', 'tensorfloat32', 'float32'), "
        f"as jnp.dot takes it; got {precision!r}") from None


def check_softcap(logit_softcap):
  if logit_softcap is not None and not (isinstance(logit_softcap, (int, float))
                                        and logit_softcap > 0):
    raise ValueError(f"logit_softcap must be None or a float > 0, got {logit_softcap=!r}")


def check_mesh(mesh, vocab_axis, batch_axis, num_columns, columns_name, leading_shape,
               leading_name) -> int:
  """The wrappers' mesh: a Mesh with both axes, a batch and a vocabulary that divide over
  them. Returns the number of vocab shards."""
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  names = set(mesh.axis_names)
  for name, axis in (("vocab_axis", vocab_axis), ("batch_axis", batch_axis)):
    for a in plumbing.axis_names(axis):
      if a not in names:
        raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}")
  shards, batch_shards = (math.prod(mesh.shape[a] for a in plumbing.axis_names(axis))
                          for axis in (vocab_axis, batch_axis))
  if batch_shards > 1 and (not leading_shape or leading_shape[0] % batch_shards):
    raise ValueError(
        f"{leading_name} = {tuple(leading_shape)} must have a first dim that divides evenly "
        f"over the {batch_shards} shards of batch_axis={batch_axis!r}: pad the batch (and mask "
        f"the padding with where= or label -100)")
  if num_columns % shards:
    raise ValueError(
        f"{columns_name} has {num_columns} vocabulary columns, which do not divide evenly over "
        f"the {shards} shards of vocab_axis={vocab_axis!r}: pad the columns to a multiple of "
        f"{shards} and pass vocab_size={num_columns}")
  return shards


# Primitives that combine several tokens: an objective using one of them is not a sum of
# per-token terms (a mean over the batch, a sequence's sum, a sort...).
_ACROSS_TOKENS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "dot_general", "conv_general_dilated", "reduce_precision_sum",
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "top_k", "scatter-add", "scatter_add",
})


def _primitives(jaxpr):
  """Every primitive name in ``jaxpr`` and the jaxprs nested in its equations."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _primitives(inner)


def check_objective(objective, num_tokens, token_args, dtype) -> bool:
  """Trace ``objective`` on ``[num_tokens]`` inputs; return whether it uses the entropy.

  Raises:
    TypeError: it is not callable, or does not return one ``[num_tokens]`` float array.
    ValueError: it combines tokens (a reduction, cumulative op, sort or matmul over its
      inputs): not a sum of per-token terms.
  """
  if not callable(objective):
    raise TypeError(f"objective must be a function (logp, entropy, *token_args) -> per-token "
                    f"terms, got {type(objective).__name__}")
  shape = jax.ShapeDtypeStruct((num_tokens,), dtype)
  args = [jax.ShapeDtypeStruct((num_tokens,), a.dtype) for a in token_args]
  closed = jax.make_jaxpr(objective)(shape, shape, *args)
  out = closed.out_avals
  if len(out) != 1 or out[0].shape != (num_tokens,) or not jnp.issubdtype(out[0].dtype,
                                                                          jnp.floating):
    raise TypeError(
        "objective must return one float array of per-token terms with the shape of its "
        f"inputs ({num_tokens},), got {[(a.shape, str(a.dtype)) for a in out]}")
  across = sorted(set(_primitives(closed.jaxpr)) & _ACROSS_TOKENS)
  if across:
    raise ValueError(
        f"objective combines tokens ({', '.join(across)}): token_loss needs a sum of "
        "per-token terms. Pass per-token weights (e.g. jaxce.objectives.token_weights) for "
        "normalizations; for sequence-level objectives (GSPO's sequence ratio) use "
        "linear_logprobs_and_entropy / logprobs_and_entropy with autodiff")
  entropy_var = closed.jaxpr.invars[1]
  reads = [v for eqn in closed.jaxpr.eqns for v in eqn.invars] + list(closed.jaxpr.outvars)
  return any(v is entropy_var for v in reads)


# --- normalizations (no checks) ----------------------------------------------------------

def vocab_dim(weight_layout) -> int:
  """The fused weight's vocabulary dim: 1 for ``"dv"`` ([D, V]), 0 for ``"vd"``."""
  return 0 if weight_layout == "vd" else 1


def broadcast_token_array(value, shape, dtype):
  """``where`` / ``temperature`` (checked) as an array of the labels' shape."""
  return jnp.broadcast_to(jnp.asarray(value), shape).astype(dtype)


def inverse_temperature(temperature, shape, dtype=jnp.float32):
  """``[*shape]`` 1/T in ``dtype`` (the compute dtype) with no gradient."""
  return lax.stop_gradient(1.0 / broadcast_token_array(temperature, shape, dtype))


def valid_mask(labels, where):
  """``[*labels.shape]`` bool: positions that are not ignored."""
  valid = labels >= 0
  if where is not None:
    valid = valid & broadcast_token_array(where, labels.shape, jnp.bool_)
  return lax.stop_gradient(valid)
