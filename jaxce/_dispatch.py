"""One path for every public operation: check once, then run the operation's per-shard
function on this device's arrays, inside the caller's ``shard_map`` / ``pmap``
(``vocab_axis`` given), or over a mesh (``sharded_*``, or arrays whose types split them
over a mesh's explicit axes: decided here, once; below, ``vocab_axis=None`` only means
"not split").

Per shard: ask the planner (``jaxce.plan.make``) for the shard's ``Plan``, then compute
``1 / temperature`` and the mask, flatten the tokens (kept ids stay ids or are packed, as
the plan says) and call the operation's kernel with a ``Config`` that holds the plan.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxce import _checks, _options, _sharded, keep as keep_mod, plan
from jaxce._kernels import linear, linear_kept_ids, linear_token_loss, logits, logits_kept_ids
from jaxce._kernels import loss_terms, plumbing, softmax, token_loss
from jaxce._kernels.mosaic import reciprocal as mosaic_reciprocal
from jaxce._kernels.config import Config, Gathered, KeptIds, Operation, Tokens


LOGPROBS = Operation("logprobs_and_entropy", False, False, logits.logprobs_entropy)
LINEAR_LOGPROBS = Operation("linear_logprobs_and_entropy", True, False,
                            linear.logprobs_entropy)
TOKEN_LOSS = Operation("token_loss", False, True, token_loss.token_loss)
LINEAR_TOKEN_LOSS = Operation("linear_token_loss", True, True,
                              linear_token_loss.linear_token_loss)


def run(op: Operation, operands, labels, request: _options.Request, *, objective=None,
        token_args=(), vocab_axis=None, mesh=None, batch_axis=None):
  """``op`` on ``operands`` (``(logits,)`` or ``(hidden, weight)``) and ``labels`` with
  the keyword options ``request`` (every keyword of the public function but
  ``vocab_axis``).

  ``mesh`` (with ``vocab_axis`` and ``batch_axis``): global arrays, run in ``shard_map``.
  Else ``vocab_axis``: this device's shard, inside the caller's ``shard_map``. Else, when
  the arrays' types split them over a mesh's explicit axes, over that mesh as they say;
  else on this device's arrays.
  """
  names = ("hidden", "weight") if op.fused else ("logits",)
  operands = tuple(_checks.as_array(n, a) for n, a in zip(names, operands))
  labels = _checks.as_array("labels", labels)
  token_entries = None
  if mesh is not None:
    token_entries = _sharded.token_spec(operands[0].ndim - 1, batch_axis)
  elif vocab_axis is None:
    others = (request.bias, request.where, request.temperature, request.keep, *token_args)
    if op.fused:
      split = _sharded.linear_split(*operands, labels, _checks.vocab_dim(request.weight_layout),
                                    *others)
    else:
      split = _sharded.logits_split(*operands, labels, *others[1:])
    if split is not None:  # split over a mesh's explicit axes: as their types say
      mesh, vocab_axis, token_entries = split
  options, operands = _options.check(op, operands, labels, request, vocab_axis=vocab_axis,
                                     mesh=mesh, batch_axis=batch_axis)
  if op.is_objective:
    token_args, options = _options.check_objective(objective, labels, token_args,
                                                   [a.dtype for a in operands[:2]], options)
  keep = request.keep
  if keep is not None and not isinstance(keep, KeptIds):
    keep = _checks.as_array("keep", keep)
  if mesh is None:
    return _shard(op, options, objective, operands, labels, request.temperature, request.where,
                  keep, token_args, vocab_axis)
  gathered = _sharded.gathered_axes(token_entries, vocab_axis)
  if gathered and not op.fused:
    raise ValueError(
        f"batch_axis={token_entries[0]!r} and vocab_axis={vocab_axis!r} share the axes "
        f"{gathered}: a token-split layout takes hidden states (linear_* functions); logits "
        "split over the vocabulary hold every token")
  if isinstance(keep, KeptIds) and _sharded.token_axes(_sharded.without(token_entries,
                                                                        gathered)):
    # (tokens split too: packed over the global columns, then split like the logits; else
    # every shard gets all the ids and takes its columns' ones)
    num_columns = operands[1].shape[options.vocab_dim] if op.fused else operands[0].shape[-1]
    keep = keep_mod.pack_ids(keep, num_columns, shape=labels.shape)
  if keep is not None:  # split like the tokens and, 32 columns a word, like the vocabulary
    operands += (keep,)
  return _on_mesh(op, options, objective, operands, labels, request, token_args, mesh,
                  vocab_axis, token_entries, gathered)


def _on_mesh(op, options, objective, operands, labels, request, token_args, mesh, vocab_axis,
             token_entries, gathered):
  """``_shard`` in ``shard_map`` over ``mesh``: the operands split over the vocabulary
  (and the tokens), every per-token array (labels, array ``temperature`` / ``where``
  broadcast to the labels' shape, the objective's ``token_args``) split like the labels,
  and the kept sets (``operands``' last, when given) like both, or kept ids whole on
  every shard.

  Token-split layout (the tokens split over axes of the vocabulary too, as sequence
  parallelism leaves the hidden states): each device gathers the hidden states of the
  devices that share its tokens' axes, runs its columns over them, and keeps its own
  tokens' outputs; the kernel sums ``d hidden`` over the shards as in the replicated
  layout (an f32 reduce-scatter, rounded once: ``plumbing.sum_over_shards``) and the
  gather's transpose keeps the device's own rows (``plumbing.gather_rows``): the
  replicated layout's bits. The per-token arrays come in whole over those axes (a few
  bytes a token). ``gathered``: those axes (``_sharded.gathered_axes``), or ``()``."""
  token_arrays = {"labels": labels}
  scalars = {}
  for name in ("temperature", "where"):
    value = getattr(request, name)
    if value is not None and jnp.ndim(value) > 0:
      value = _checks.as_array(name, value)
      token_arrays[name] = _checks.broadcast_token_array(value, labels.shape, value.dtype)
    else:
      scalars[name] = value
  token_arrays.update({f"arg{k}": a for k, a in enumerate(token_args)})
  token_in_entries = _sharded.without(token_entries, gathered)
  keep_spec = P() if isinstance(operands[-1], KeptIds) else P(*token_in_entries, vocab_axis)
  if op.fused:
    bias = operands[2]
    arrays = operands[:2] + (() if bias is None else (bias,))
    weight_spec = (vocab_axis, None) if options.vocab_dim == 0 else (None, vocab_axis)
    specs = (P(*token_entries, None), P(*weight_spec), P(vocab_axis))[:len(arrays)]
  else:
    arrays, specs = operands[:1], (P(*token_entries, vocab_axis),)
  if options.has_keep:
    arrays, specs = arrays + operands[-1:], specs + (keep_spec,)
  axes = _sharded.token_axes(token_in_entries)  # (the loss of gathered tokens is whole)

  def shard_fn(*shard_arrays, labels, **token):
    args = [token.pop(f"arg{k}") for k in range(len(token_args))]
    keep = shard_arrays[-1] if options.has_keep else None
    shard_arrays = shard_arrays[:-1] if options.has_keep else shard_arrays
    own_tokens = shard_arrays[0].shape[0]  # (the leading dim's: the outputs' own rows)
    # (the kernels' rows are the tokens flattened: a device's own [B, S, D] are B * S rows)
    own_rows = math.prod(shard_arrays[0].shape[:-1])
    if gathered:
      shard_arrays = (plumbing.gather_rows(shard_arrays[0], gathered), *shard_arrays[1:])
    shard_operands = shard_arrays + ((None,) if op.fused and len(shard_arrays) == 2 else ())
    out = _shard(op, options, objective, shard_operands, labels,
                 token.get("temperature", scalars.get("temperature")),
                 token.get("where", scalars.get("where")), keep, args, vocab_axis,
                 Gathered(gathered, own_rows) if gathered else None)
    if op.is_objective:
      loss, (logp, entropy) = out
      out = (lax.psum(loss, axes) if axes else loss), logp, entropy
    if not gathered:
      return out
    start = lax.axis_index(gathered) * own_tokens  # this device's own tokens
    own = lambda x: None if x is None else lax.dynamic_slice_in_dim(x, start, own_tokens, 0)
    return (out[0], *map(own, out[1:])) if op.is_objective else tuple(map(own, out))

  kinds = ("token", "token") if options.return_entropy else ("token",)
  if op.is_objective:
    kinds = ("scalar",) + kinds
  out = _sharded.run(shard_fn, arrays, specs, token_arrays, mesh, token_entries, kinds,
                     token_in_entries)
  if op.is_objective:
    return out[0], _per_token_outputs(out[1:])
  return _per_token_outputs(out)


def _per_token_outputs(out):
  """``(logp, entropy or None)`` from the wrapper's outputs."""
  return out if len(out) == 2 else (out[0], None)


def _shard(op, options, objective, operands, labels, temperature, where, keep, token_args,
           vocab_axis, gathered=None):
  """Flatten, normalize, plan and run ``op``'s kernel on this device's (shard's) arrays;
  ``gathered``: how the hidden states were gathered (``Config.gathered``), or None."""
  primary = operands[0]
  dtype = softmax.compute_dtype(*(a.dtype for a in operands[:2]))
  with_entropy = options.return_entropy
  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, dtype)
    outputs = zeros, (zeros if with_entropy else None)
    return (jnp.zeros((), dtype), outputs) if op.is_objective else outputs
  num_tokens = labels.size
  num_columns = operands[1].shape[options.vocab_dim] if op.fused else primary.shape[-1]
  shard_plan = plan.make(op, options, plan.Shard(
      num_tokens=num_tokens, num_columns=num_columns,
      dtypes=tuple(a.dtype for a in operands[:2]),
      depth=primary.shape[-1] if op.fused else None,
      has_bias=op.fused and operands[2] is not None,
      num_kept_ids=keep.ids.shape[0] if isinstance(keep, KeptIds) else None,
      number_temperature=isinstance(temperature, (int, float)),
      num_shards=softmax.num_shards(vocab_axis)))
  inv_temp = _inverse_temperature(temperature, labels.shape, dtype, shard_plan.reciprocal)
  valid = _checks.valid_mask(labels, where)
  if op.fused:
    hidden, weight, bias = operands
    flat = (hidden.reshape(num_tokens, hidden.shape[-1]), weight, bias)
  else:
    flat = (primary.reshape(num_tokens, num_columns),)
  config = Config(
      plan=shard_plan, vocab_size=options.vocab_size,
      vocab_axis=vocab_axis, with_entropy=with_entropy, logit_softcap=options.logit_softcap,
      vocab_dim=options.vocab_dim, hidden_grad_accumulation=options.hidden_grad_accumulation,
      gathered=gathered)
  if isinstance(keep, KeptIds) and not shard_plan.kept_ids:  # this shard's columns, packed
    keep = keep_mod.pack_ids(keep, num_columns, shape=(num_tokens,),
                             first_column=softmax.shard_column_start(num_columns, vocab_axis))
  if isinstance(keep, KeptIds):
    kept = KeptIds(keep.ids.astype(jnp.int32), keep.token.astype(jnp.int32))
  else:
    kept = None if keep is None else keep.reshape(num_tokens, keep.shape[-1])
  tokens = Tokens(labels.reshape(-1).astype(jnp.int32), inv_temp.reshape(-1), valid.reshape(-1),
                  kept)
  kept_ids_kernel = (linear_kept_ids if op.fused else logits_kept_ids).logprobs_entropy
  if not op.is_objective:
    kernel = kept_ids_kernel if shard_plan.kept_ids else op.kernel
    out = kernel(*flat, tokens, config)
    return out[0].reshape(labels.shape), (out[1].reshape(labels.shape) if with_entropy
                                          else None)
  flat_args = tuple(lax.stop_gradient(jnp.broadcast_to(a, labels.shape).reshape(-1))
                    for a in token_args)
  if shard_plan.kept_ids:  # the per-token kept-ids kernel under autodiff
    loss, (logp, entropy) = loss_terms.per_token_loss(objective, kept_ids_kernel, flat, tokens,
                                                      flat_args, config)
  else:
    loss, (logp, entropy) = op.kernel(objective, *flat, tokens, flat_args, config)
  logp = lax.stop_gradient(logp.reshape(labels.shape))
  return loss, (logp, None if entropy is None else lax.stop_gradient(entropy.reshape(labels.shape)))


def _inverse_temperature(temperature, shape, dtype, reciprocal):
  """``[*shape]`` ``1 / temperature`` in ``dtype``, no gradient, computed as the plan's
  ``reciprocal`` says (``jaxce.plan``'s ``_reciprocal`` says why): ``"xla"``, XLA's
  division; ``"barrier"``, XLA's division behind an optimization barrier (constant
  folding does not cross it); ``"mosaic"``, ``mosaic_reciprocal``'s kernel."""
  if reciprocal == "xla":
    return _checks.inverse_temperature(temperature, shape, dtype)
  t = _checks.broadcast_token_array(temperature, shape, dtype).reshape(-1)
  if reciprocal == "mosaic":
    inv_temp = mosaic_reciprocal.reciprocal(t, interpret=False)
  else:
    inv_temp = 1 / lax.optimization_barrier(t)
  return lax.stop_gradient(inv_temp.reshape(shape))
