"""``jax.shard_map`` wrappers for global arrays: they wire partition specs, no maths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxce import _checks
from jaxce._linear import linear_logprobs_and_entropy
from jaxce._logits import logprobs_and_entropy


def _token_spec(ndim, batch_axis):
  return P(*((batch_axis,) + (None,) * (ndim - 1))) if ndim else P()


def _check_mesh(mesh, vocab_axis, batch_axis):
  names = set(mesh.axis_names)
  for name, axis in (("vocab_axis", vocab_axis), ("batch_axis", batch_axis)):
    for a in (axis if isinstance(axis, tuple) else (axis,)):
      if a is not None and a not in names:
        raise ValueError(f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}")


def _token_options(kw, labels, ndim):
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


def _run(kernel, arrays, specs, labels, mesh, vocab_axis, batch_axis, kw):
  token_arrays = _token_options(kw, labels, labels.ndim)
  token_spec = _token_spec(labels.ndim, batch_axis)
  names = list(token_arrays)
  return_entropy = kw.get("return_entropy", True)

  def body(*args):
    n = len(arrays)
    extra = dict(zip(names, args[n + 1:]))
    logp, entropy = kernel(*args[:n], args[n], vocab_axis=vocab_axis, **kw, **extra)
    return (logp, entropy) if return_entropy else logp

  out_specs = (token_spec, token_spec) if return_entropy else token_spec
  f = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs) + (token_spec,) * (1 + len(names)),
                    out_specs=out_specs)
  out = f(*arrays, labels, *token_arrays.values())
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
  _check_mesh(mesh, vocab_axis, batch_axis)
  labels = jnp.asarray(labels)
  logits = jnp.asarray(logits)
  spec = P(*(tuple(_token_spec(logits.ndim - 1, batch_axis)) + (vocab_axis,)))
  return _run(logprobs_and_entropy, (logits,), (spec,), labels, mesh, vocab_axis, batch_axis,
              dict(kw))


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
  _check_mesh(mesh, vocab_axis, batch_axis)
  labels = jnp.asarray(labels)
  hidden = jnp.asarray(hidden)
  bias = kw.pop("bias", None)
  weight_spec = P(vocab_axis, None) if kw.get("weight_layout") == "vd" else P(None, vocab_axis)
  arrays, specs = [hidden, jnp.asarray(weight)], [
      P(*(tuple(_token_spec(hidden.ndim - 1, batch_axis)) + (None,))), weight_spec]

  def kernel(h, w, *rest, **options):
    *b, labels_local = rest
    return linear_logprobs_and_entropy(h, w, labels_local, bias=b[0] if b else None, **options)

  if bias is not None:
    arrays.append(jnp.asarray(bias))
    specs.append(P(vocab_axis))
  return _run(kernel, tuple(arrays), specs, labels, mesh, vocab_axis, batch_axis, dict(kw))
