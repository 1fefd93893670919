"""``jax.shard_map`` wrappers for global arrays: they wire partition specs, no maths."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxce import _checks
from jaxce._linear import linear_logprobs_and_entropy
from jaxce._logits import logprobs_and_entropy


def _token_spec(ndim, batch_axis):
  return P(*((batch_axis,) + (None,) * (ndim - 1))) if ndim else P()


def _check_call(mesh, vocab_axis, batch_axis, num_columns, columns_name, labels, leading_shape,
                leading_name, kw):
  """What can be checked on the global arrays before shard_map traces them: the mesh and
  its axes, the vocabulary's split, and the concrete values (labels in range, temperature)
  whose errors would otherwise become NaN inside the traced body."""
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  names = set(mesh.axis_names)
  for name, axis in (("vocab_axis", vocab_axis), ("batch_axis", batch_axis)):
    for a in _axis_names(axis):
      if a not in names:
        raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}")
  shards, batch_shards = (math.prod(mesh.shape[a] for a in _axis_names(axis))
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
  _checks.check_labels(labels, leading_shape, leading_name)
  if kw.get("temperature") is not None:
    _checks.check_temperature(kw["temperature"])
  vocab_size = _checks.check_vocab_size(kw.get("vocab_size"), num_columns, columns_name)
  _checks.check_labels_in_range(labels, _checks.valid_mask(labels, kw.get("where")), vocab_size)


def _token_options(kw, labels):
  """Split per-token array options (temperature, where) out as extra shard_map inputs."""
  arrays = {}
  for name in ("temperature", "where"):
    value = kw.pop(name, None)
    if value is not None and jnp.ndim(value) > 0:
      value = _checks.as_array(name, value)
      arrays[name] = _checks.broadcast_token_array(name, value, labels.shape, value.dtype)
    elif value is not None:
      kw[name] = value
  return arrays


def _axis_names(entry):
  """The mesh axis names of one ``PartitionSpec`` entry (``None``, a name or a tuple)."""
  return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def _explicit_axes(mesh):
  return {name for name, kind in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
          if kind == jax.sharding.AxisType.Explicit}


def _typed_split(x):
  """``(mesh, spec)`` when ``x``'s type splits it over explicit mesh axes (the spec one
  entry per dim), else ``None``. Inside ``shard_map`` the axes are manual: ``None``."""
  if x is None or not hasattr(x, "ndim"):
    return None
  concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
  sharding = x.sharding if concrete else getattr(jax.typeof(x), "sharding", None)
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None:
    return None
  explicit = _explicit_axes(mesh)
  if not any(n in explicit for entry in spec for n in _axis_names(entry)):
    return None
  return mesh, tuple(spec) + (None,) * (x.ndim - len(spec))


def explicit_split(*arrays):
  """The first explicit ``(mesh, spec)`` among ``arrays`` (see :func:`_typed_split`)."""
  return next(filter(None, map(_typed_split, arrays)), None)


def _spec_of(x):
  """``x``'s explicit split, one entry per dim (all ``None`` when it has none)."""
  return (_typed_split(x) or (None, (None,) * x.ndim))[1]


def _typed_token_spec(leading, labels):
  """How the token dims are split: as ``leading`` (the input's entries before its last
  dim) says, or, when that splits nothing, as the labels' type says."""
  return tuple(leading) if any(leading) else _spec_of(labels)


def _placed(arrays, specs, mesh):
  """``arrays`` split as ``specs`` say. On a mesh with explicit axes (``jax.make_mesh``'s
  default) every array's type carries its sharding and ``shard_map`` takes only arrays
  already split as its ``in_specs``; reshard them (no data moves when they already are).
  Over auto axes ``shard_map`` reshards by itself (and ``reshard`` takes none)."""
  explicit = _explicit_axes(mesh)
  if not explicit:
    return arrays

  def explicit_part(entry):
    names = tuple(n for n in _axis_names(entry) if n in explicit)
    return names if len(names) > 1 else (names[0] if names else None)

  return tuple(jax.sharding.reshard(a, NamedSharding(mesh, P(*map(explicit_part, s))))
               for a, s in zip(arrays, specs))


def _run(kernel, arrays, specs, labels, mesh, vocab_axis, token_spec, kw):
  token_arrays = _token_options(kw, labels)
  token_spec = P(*token_spec)
  names = list(token_arrays)
  return_entropy = kw.get("return_entropy", True)

  def body(*args):
    n = len(arrays)
    extra = dict(zip(names, args[n + 1:]))
    logp, entropy = kernel(*args[:n], args[n], vocab_axis=vocab_axis, **kw, **extra)
    return (logp, entropy) if return_entropy else logp

  out_specs = (token_spec, token_spec) if return_entropy else token_spec
  in_specs = tuple(specs) + (token_spec,) * (1 + len(names))
  # jit: an eager shard_map cannot run a custom_vjp with symbolic zeros; under an outer
  # jit this is inlined.
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
  out = f(*_placed((*arrays, labels, *token_arrays.values()), in_specs, mesh))
  return out if return_entropy else (out, None)


def sharded_logprobs_and_entropy(logits, labels, *, mesh, vocab_axis, batch_axis=None, **kw):
  """:func:`jaxce.logprobs_and_entropy` on global arrays over ``mesh``.

  Args:
    logits: global ``[B, ..., V]``; the last dim is split over ``vocab_axis`` and, with
      ``batch_axis``, the first dim over ``batch_axis``. V must divide by the shard count.
    labels: global int ``[B, ...]`` of global ids.
    mesh: a ``jax.sharding.Mesh``.
    vocab_axis, batch_axis: mesh axis names (or tuples of names).
    **kw: any keyword of :func:`jaxce.logprobs_and_entropy`; array ``temperature`` and
      ``where`` are broadcast to ``labels.shape`` and split like the labels.

  Returns:
    ``(logp, entropy)`` global float32 arrays of ``labels.shape``, split like the labels.
  """
  logits = _checks.as_array("logits", logits)
  labels = _checks.as_array("labels", labels)
  return _logits_call(logits, labels, mesh, vocab_axis, batch_axis,
                      _token_spec(logits.ndim - 1, batch_axis), kw)


def _logits_call(logits, labels, mesh, vocab_axis, batch_axis, token_spec, kw):
  """The logits wrapper with the token dims split as ``token_spec`` (one entry per dim)."""
  _checks.check_float("logits", logits)
  _check_call(mesh, vocab_axis, batch_axis, logits.shape[-1], "logits", labels,
              logits.shape[:-1], "logits.shape[:-1]", kw)
  spec = P(*token_spec, vocab_axis)
  return _run(logprobs_and_entropy, (logits,), (spec,), labels, mesh, vocab_axis, token_spec,
              dict(kw))


def split_like_their_types(logits, labels, kw):
  """:func:`jaxce.logprobs_and_entropy` on arrays whose types split them over a mesh's
  explicit axes (``jax.make_mesh``'s default), through the wrapper: the token dims stay
  split as the logits' type says (else the labels'), the vocabulary as its last dim says.
  ``None`` when no input is split over explicit axes."""
  split = explicit_split(logits, labels, kw.get("where"), kw.get("temperature"))
  if split is None:
    return None
  logits_spec = _spec_of(logits)
  return _logits_call(logits, labels, split[0], logits_spec[-1], None,
                      _typed_token_spec(logits_spec[:-1], labels), kw)


def sharded_linear_logprobs_and_entropy(hidden, weight, labels, *, mesh, vocab_axis,
                                        batch_axis=None, **kw):
  """:func:`jaxce.linear_logprobs_and_entropy` on global arrays over ``mesh``.

  Args:
    hidden: global ``[B, ..., D]``, the first dim split over ``batch_axis`` if given.
    weight: global ``[D, V]`` (``[V, D]`` with ``weight_layout="vd"``), the vocab split
      over ``vocab_axis``; ``bias`` (in ``kw``) ``[V]`` likewise.
    labels: global int ``[B, ...]``.
    **kw: any keyword of :func:`jaxce.linear_logprobs_and_entropy`.

  Returns:
    ``(logp, entropy)`` global float32 arrays of ``labels.shape``. ``d hidden`` is
    reduced over ``vocab_axis`` inside; ``d weight`` stays split.
  """
  hidden = _checks.as_array("hidden", hidden)
  weight = _checks.as_array("weight", weight)
  labels = _checks.as_array("labels", labels)
  return _linear_call(hidden, weight, labels, mesh, vocab_axis, batch_axis,
                      _token_spec(hidden.ndim - 1, batch_axis), kw)


def linear_split_like_their_types(hidden, weight, labels, kw):
  """:func:`jaxce.linear_logprobs_and_entropy` on arrays whose types split them over a
  mesh's explicit axes, through the wrapper: the token dims stay split as ``hidden``'s type
  says (else the labels'), the vocabulary as the weight's vocab dim says; a split ``D`` is
  gathered. ``None`` when no input is split over explicit axes."""
  split = explicit_split(hidden, weight, labels, kw.get("bias"), kw.get("where"),
                         kw.get("temperature"))
  if split is None:
    return None
  vocab_dim = 0 if kw.get("weight_layout") == "vd" else 1
  vocab_axis = _spec_of(weight)[vocab_dim] if weight.ndim == 2 else None
  return _linear_call(hidden, weight, labels, split[0], vocab_axis, None,
                      _typed_token_spec(_spec_of(hidden)[:-1], labels), kw)


def _linear_call(hidden, weight, labels, mesh, vocab_axis, batch_axis, token_spec, kw):
  """The fused wrapper with the token dims split as ``token_spec`` (one entry per dim)."""
  _checks.check_float("hidden", hidden)
  _checks.check_float("weight", weight)
  vocab_dim = 0 if kw.get("weight_layout") == "vd" else 1
  if weight.ndim != 2:
    raise ValueError(f"weight must be 2-D ([D, V], or [V, D] with weight_layout='vd'), got "
                     f"{weight.shape=}")
  _check_call(mesh, vocab_axis, batch_axis, weight.shape[vocab_dim], "weight", labels,
              hidden.shape[:-1], "hidden.shape[:-1]", kw)
  kw = dict(kw)
  bias = kw.pop("bias", None)
  weight_spec = P(vocab_axis, None) if vocab_dim == 0 else P(None, vocab_axis)
  arrays, specs = [hidden, weight], [P(*token_spec, None), weight_spec]

  def kernel(h, w, *rest, **options):
    *b, labels_local = rest
    return linear_logprobs_and_entropy(h, w, labels_local, bias=b[0] if b else None, **options)

  if bias is not None:
    arrays.append(_checks.as_array("bias", bias))
    specs.append(P(vocab_axis))
  return _run(kernel, tuple(arrays), specs, labels, mesh, vocab_axis, token_spec, kw)
