"""``jax.shard_map`` wiring for global arrays: partition specs and resharding, no maths
and no checks (the front door, ``jaxce._dispatch``, has checked the global arrays and passes
the function each shard runs)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxce._kernels import plumbing


def token_spec(ndim, batch_axis):
  """The token dims' spec entries: the first split over ``batch_axis``, the rest whole."""
  return ((batch_axis,) + (None,) * (ndim - 1)) if ndim else ()


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
  if not any(n in explicit for entry in spec for n in plumbing.axis_names(entry)):
    return None
  return mesh, tuple(spec) + (None,) * (x.ndim - len(spec))


def _explicit_mesh(*arrays):
  """The mesh of the first of ``arrays`` split over explicit mesh axes (``jax.make_mesh``'s
  default), or ``None``."""
  split = next(filter(None, map(_typed_split, arrays)), None)
  return None if split is None else split[0]


def _spec_of(x):
  """``x``'s explicit split, one entry per dim (all ``None`` when it has none)."""
  return (_typed_split(x) or (None, (None,) * x.ndim))[1]


def _typed_token_spec(leading, labels):
  """How the token dims are split: as ``leading`` (an input's entries before its last
  dim) says, or, when that splits nothing, as the labels' type says."""
  return tuple(leading) if any(leading) else _spec_of(labels)


def logits_split(logits, labels, *others):
  """``(mesh, vocab_axis, token entries)`` when the logits, the labels or ``others`` are
  split over a mesh's explicit axes: the tokens as the logits' type says (else the
  labels'), the vocabulary as the logits' last dim says. ``None`` otherwise."""
  mesh = _explicit_mesh(logits, labels, *others)
  if mesh is None:
    return None
  spec = _spec_of(logits)
  return mesh, spec[-1], _typed_token_spec(spec[:-1], labels)


def linear_split(hidden, weight, labels, vocab_dim, *others):
  """``(mesh, vocab_axis, token entries)`` when the inputs of a fused call are split over a
  mesh's explicit axes: the tokens as ``hidden``'s type says (else the labels'), the
  vocabulary as the weight's ``vocab_dim`` says (a split ``D`` is gathered). ``None``
  otherwise."""
  mesh = _explicit_mesh(hidden, weight, labels, *others)
  if mesh is None:
    return None
  vocab_axis = _spec_of(weight)[vocab_dim] if weight.ndim == 2 else None
  return mesh, vocab_axis, _typed_token_spec(_spec_of(hidden)[:-1], labels)


def _placed(arrays, specs, mesh):
  """``arrays`` split as ``specs`` say. On a mesh with explicit axes (``jax.make_mesh``'s
  default) every array's type carries its sharding and ``shard_map`` takes only arrays
  already split as its ``in_specs``; reshard them (no data moves when they already are).
  Over auto axes ``shard_map`` reshards by itself (and ``reshard`` takes none)."""
  explicit = _explicit_axes(mesh)
  if not explicit:
    return arrays

  def explicit_part(entry):
    names = tuple(n for n in plumbing.axis_names(entry) if n in explicit)
    return names if len(names) > 1 else (names[0] if names else None)

  return tuple(jax.sharding.reshard(a, NamedSharding(mesh, P(*map(explicit_part, s))))
               for a, s in zip(arrays, specs))


def token_axes(token_entries):
  """The mesh axes the token dims are split over (a loss sums over them)."""
  return tuple(n for entry in token_entries for n in plumbing.axis_names(entry))


def gathered_axes(token_entries, vocab_axis):
  """The mesh axes that split both the tokens and the vocabulary (the token-split layout
  of sequence parallelism: each device holds its tokens' hidden states and its columns of
  the weight), in the order the first token dim's entry names them; ``()`` when none.
  They must be that entry's last (minor) axes, so that gathering a device's hidden states
  over them gives a contiguous block of tokens: a ValueError says so."""
  vocab = set(plumbing.axis_names(vocab_axis))
  entries = [plumbing.axis_names(entry) for entry in token_entries]
  if not any(vocab & set(names) for names in entries):
    return ()
  first = entries[0]
  shared = tuple(a for a in first if a in vocab)
  minor = first[len(first) - len(shared):] == shared
  if any(vocab & set(names) for names in entries[1:]) or not minor:
    raise ValueError(
        f"batch_axis={token_entries[0]!r} shares axes with vocab_axis={vocab_axis!r} (the "
        "token-split layout): those axes must be the last ones of batch_axis, which splits "
        "the first token dim only")
  return shared


def without(token_entries, axes):
  """``token_entries`` with the mesh ``axes`` left out (None where no axis is left)."""
  def entry_without(entry):
    names = tuple(a for a in plumbing.axis_names(entry) if a not in axes)
    return names if len(names) > 1 else (names[0] if names else None)
  return tuple(map(entry_without, token_entries))


def run(shard_fn, arrays, specs, token_arrays, mesh, token_entries, out_kinds,
        token_in_entries=None):
  """``shard_fn`` on each shard of ``arrays`` (split as ``specs``) and of the per-token
  ``token_arrays`` (a dict of arrays of the labels' shape, the labels first, split as
  ``token_in_entries``, by default ``token_entries``): ``shard_fn(*arrays,
  **token_arrays)`` returns a tuple of arrays, each ``"token"`` (the labels' shape, split
  as ``token_entries``) or ``"scalar"`` (the same on every shard) as ``out_kinds`` says.
  Returns that tuple of global arrays."""
  names = list(token_arrays)
  spec = P(*token_entries)
  in_spec = spec if token_in_entries is None else P(*token_in_entries)

  def body(*args):  # outputs that are None (an entropy not asked for) are left out
    out = shard_fn(*args[:len(arrays)], **dict(zip(names, args[len(arrays):])))
    return tuple(o for o in out if o is not None)

  out_specs = tuple(spec if kind == "token" else P() for kind in out_kinds)
  in_specs = tuple(specs) + (in_spec,) * len(names)
  # jit: an eager shard_map cannot run a custom_vjp with symbolic zeros; under an outer
  # jit this is inlined.
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
  return f(*_placed((*arrays, *token_arrays.values()), in_specs, mesh))
