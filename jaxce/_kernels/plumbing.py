"""JAX's type plumbing for the kernels, no maths: the varying types of values inside
``shard_map`` (what a scan carry or a Pallas output must vary over, and the sum that
transposes an implicit broadcast), ``custom_vjp``'s symbolic zeros, and the Pallas
backends imported when first used."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jaxce._kernels import softmax


def lazy_module(name: str):
  """The module ``name`` (a Pallas backend, ``jax.experimental.pallas.triton`` or
  ``.mosaic_gpu``), imported when an attribute is first read, or None when this JAX has
  no such module. So ``import jaxce`` loads neither backend (a third of a second), and a
  JAX without one still runs every call that does not need it."""
  if name in sys.modules:
    return sys.modules[name]
  try:
    spec = importlib.util.find_spec(name)
  except ImportError:
    spec = None
  if spec is None:
    return None
  spec.loader = importlib.util.LazyLoader(spec.loader)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def mosaic_gpu_unsupported(plgpu, platform, capability) -> str | None:
  """Why a Pallas Mosaic GPU kernel cannot run on ``platform`` (``capability``: its GPUs'
  compute capability) with ``plgpu`` (the kernel module's lazily imported backend, or
  None), a sentence, or None: it runs on Hopper GPUs and, in JAX's GPU interpreter
  (JAX >= 0.11), off GPUs."""
  if plgpu is None:
    return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU backend"
  if platform == "gpu":
    if capability != "9.0":
      return f"it needs a Hopper GPU (compute capability 9.0), got {capability}"
  elif not hasattr(plgpu, "InterpretGPUParams"):
    return f"off GPUs it runs in the GPU interpreter of JAX >= 0.11, got {jax.__version__}"
  return None


def custom_vjp(*static: str):
  """``jax.custom_vjp`` whose non-differentiable arguments are named (``static``), not
  numbered: adding an argument to the function shifts nothing."""
  def wrap(fn):
    names = list(inspect.signature(fn).parameters)
    return jax.custom_vjp(fn, nondiff_argnums=tuple(names.index(n) for n in static))
  return wrap


def symbolic_zero_to_none(cotangent):
  return None if isinstance(cotangent, SymbolicZero) else cotangent


def primal_values(tree):
  """A ``custom_vjp`` forward rule's arguments (``symbolic_zeros=True`` wraps each array
  as a ``CustomVJPPrimal``) as plain arrays, in the same pytree."""
  return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _manual_type(x):
  """``(keyword, value)`` of ``x``'s type over manual mesh axes as ``jax.ShapeDtypeStruct``
  takes it (``manual_axis_type=aval.mat`` in JAX >= 0.10, ``vma=aval.vma`` before), or
  ``None`` when ``x`` varies over none (outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return ("manual_axis_type", mat) if mat.varying else None
  vma = getattr(aval, "vma", None)
  return ("vma", vma) if vma else None


def varying_axes(x):
  """The manual mesh axes ``x`` varies over; empty outside shard_map."""
  manual = _manual_type(x)
  if manual is None:
    return frozenset()
  keyword, value = manual
  return frozenset(value.varying if keyword == "manual_axis_type" else value)


def shape_dtype_like(x, shape, dtype):
  """A ``jax.ShapeDtypeStruct`` that varies over the same shard_map axes as ``x``
  (``check_vma`` needs it spelled out for a Pallas kernel's outputs)."""
  mat = getattr(jax.typeof(x), "mat", None)
  if mat is not None:  # (spelled out even when x varies over no axis: check_vma wants it)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  manual = _manual_type(x)
  return jax.ShapeDtypeStruct(shape, dtype, **(dict([manual]) if manual else {}))


def axis_names(entry):
  """The mesh axis names of ``vocab_axis`` / a ``PartitionSpec`` entry (None, a name or a
  tuple of names), as a tuple."""
  return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def unify_varying(arrays, vocab_axis):
  """Cast every array (``None`` passes through) to vary over the union of the arrays'
  manual axes and ``vocab_axis``, so that scan carries built from any of them type-check
  inside ``shard_map``. A no-op outside shard_map; under pmap, where values carry no
  varying type, the arrays come back unchanged."""
  union = frozenset(axis_names(vocab_axis)).union(
      *(varying_axes(a) for a in arrays if a is not None))
  out = []
  for a in arrays:
    missing = () if a is None else tuple(sorted(union - varying_axes(a)))
    if missing:
      try:
        a = lax.pcast(a, missing, to="varying")
      except (NameError, ValueError):  # pmap: no varying types to match
        return tuple(arrays)
    out.append(a)
  return tuple(out)


def sum_over_shards(partial, vocab_axis, primal, dtype, gathered=None):
  """``partial``, a cotangent's partial sums over the vocabulary shards (``d hidden``:
  each shard's columns' part, f32), summed over the axes of ``vocab_axis`` that ``primal``
  does not vary over or that ``gathered`` names, and cast to ``dtype``.

  - Hidden states replicated over the vocabulary axis (the usual layout) get the whole
    sum on every shard.
  - Hidden states gathered by ``gather_rows`` (the token-split layout; ``gathered``, a
    ``Config.gathered``: its axes and each device's own rows) get the whole sum at least
    in the device's own rows, which that gather's transpose keeps: all the rows (the
    vocab-outer backward) by a reduce-scatter over the gathered axes in f32, then cast;
    a chunk of them by the replicated layout's sum.
  - Hidden states that vary over the vocabulary axis otherwise (gathered inside a
    caller's own ``shard_map`` by ``lax.all_gather``) keep their shard's part, which the
    gather's transpose sums as it scatters (a reduce-scatter in ``dtype``).

  Under pmap (no varying types) every axis of ``vocab_axis`` is summed; outside
  shard_map, none.

  The sum is the f32 all-reduce's, rounded once to ``dtype``: where ``dtype`` is narrower
  and the shards divide the rows, as an f32 reduce-scatter, each shard's rows cast, then
  an all-gather in ``dtype`` (a quarter less traffic than the f32 all-reduce, and no f32
  array of all the rows beyond ``partial``)."""
  varying = varying_axes(primal)
  gathered_axes = () if gathered is None else gathered.axes
  axes = tuple(a for a in axis_names(vocab_axis) if a not in varying or a in gathered_axes)
  if not axes:
    return partial.astype(dtype)
  if gathered_axes and partial.shape[0] == primal.shape[0]:
    return _own_rows_sum(partial, axes, gathered, dtype)
  narrower = jnp.dtype(dtype).itemsize < partial.dtype.itemsize
  if not narrower or partial.shape[0] % softmax.num_shards(axes):
    total = lax.psum(partial, axes).astype(dtype)
  else:
    rows = lax.psum_scatter(partial, axes, scatter_dimension=0, tiled=True)
    # (invariant, as the all-reduce's sum is: the same rows on every shard)
    total = lax.all_gather(rows.astype(dtype), axes, axis=0, tiled=True, to="invarying")
  # (a gathered primal varies over the gathered axes: its cotangent must too)
  missing = tuple(sorted(varying & set(axes)))
  return lax.pcast(total, missing, to="varying") if missing else total


def _own_rows_sum(partial, axes, gathered, dtype):
  """``partial`` (every gathered row, and the padding a kernel added after them) summed
  over ``axes`` in this device's own rows only (``gathered.rows`` from its index over
  ``gathered.axes``; the other rows zeros): a reduce-scatter over the gathered
  axes, after an all-reduce over any other vocabulary axes (hidden states replicated
  over them)."""
  others = tuple(a for a in axes if a not in gathered.axes)
  if others:
    partial = lax.psum(partial, others)
  gathered_rows = gathered.rows * softmax.num_shards(gathered.axes)
  own = lax.psum_scatter(partial[:gathered_rows], gathered.axes, scatter_dimension=0,
                         tiled=True).astype(dtype)
  start = lax.axis_index(gathered.axes) * gathered.rows
  return lax.dynamic_update_slice_in_dim(jnp.zeros_like(partial, dtype), own, start, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_rows(x, axes):
  """``x``'s rows gathered over the mesh ``axes`` (``lax.all_gather``, tiled, in the
  order ``axes`` names them), for a kernel whose backward sums ``d hidden`` over them
  itself (``sum_over_shards`` with ``gathered``): the transpose keeps this device's own
  rows of a cotangent whose own rows hold the whole sum, where ``lax.all_gather``'s would
  sum the devices' cotangents again. Memory: the gathered ``[n * rows, ...]`` array."""
  return lax.all_gather(x, axes, axis=0, tiled=True)


def _gather_rows_fwd(x, axes):
  return gather_rows(x, axes), None


def _gather_rows_bwd(axes, _, cotangent):
  rows = cotangent.shape[0] // softmax.num_shards(axes)
  return (lax.dynamic_slice_in_dim(cotangent, lax.axis_index(axes) * rows, rows, 0),)


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def reduce_to_varying(cotangent, primal):
  """Sum a cotangent over the manual axes its primal does not vary over (the transpose
  of the implicit broadcast that made the primal varying)."""
  extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
  return lax.psum(cotangent, extra) if extra else cotangent


