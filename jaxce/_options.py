"""The front door's records: a call's keyword options as passed (:class:`Request`, built
by the public function) and, after the checks, as the kernels read them (:class:`Options`).

``check`` validates a call's arrays and its :class:`Request` (every error names the
argument, its shape or value, and what was expected) and returns :class:`Options`; no
keyword travels in a dict. Where the call runs (``jaxce.plan.target``) is decided
here too, once, so every shard plans for the same platform.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxce import _checks, plan
from jaxce._kernels import softmax

HIDDEN_GRAD_ACCUMULATIONS = ("float32", "output")


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
  """One call's keyword options as the caller passed them, unchecked (the public
  functions' keywords, ``vocab_axis`` apart; an option a function does not take keeps its
  default here). Their meanings: the public functions' docstrings."""
  temperature: Any = 1.0
  where: Any = None
  vocab_size: int | None = None
  chunk_size: int | None = None
  return_entropy: bool | None = True
  implementation: str | None = None
  keep: Any = None
  batch_invariant: bool = False
  backward_in_place: bool = False
  bias: Any = None
  logit_softcap: float | None = None
  vocab_block_size: int | None = None
  weight_layout: str = "dv"
  hidden_grad_accumulation: str = "float32"
  precision: Any = None


@dataclasses.dataclass(frozen=True)
class Options:
  """One call's checked options.

  Attributes:
    vocab_size: the logical vocabulary (all the columns unless padded), global ids.
    vocab_shards: how many shards the vocabulary is split over (1: not split).
    return_entropy: compute (and return) the entropy. Objective paths: the objective uses
      it or the caller asked for it.
    chunk_size, implementation: as passed (the planner reads ``"pallas"`` as
      ``"triton"``); the planner turns them into a ``Plan``.
    target: where the call runs (``jaxce.plan.Target``).
    backward_in_place: the logits path's backward overwrites the logits.
    logit_softcap: the fused paths' softcap ``c`` (a float), or ``None``.
    vocab_block_size: the fused per-token path's vocab columns per tile, or ``None``.
    vocab_dim: the fused weight's vocabulary dim (1: ``[D, V]``, 0: ``[V, D]``).
    hidden_grad_accumulation: the fused per-token backward's ``d hidden`` sum.
    has_keep: the call has kept sets (``keep=``).
    batch_invariant: each token's outputs depend on its own inputs only (``True``).
    precision: the fused paths' matmul precision as ``jax.lax.Precision``'s name
      (``"default"``, ``"high"`` or ``"highest"``), or ``None``: JAX's
      ``jax_default_matmul_precision`` when the call is traced.
  """
  vocab_size: int
  vocab_shards: int
  return_entropy: bool
  chunk_size: int | None
  implementation: str | None
  target: plan.Target
  backward_in_place: bool = False
  logit_softcap: float | None = None
  vocab_block_size: int | None = None
  vocab_dim: int = 1
  hidden_grad_accumulation: str = "float32"
  has_keep: bool = False
  batch_invariant: bool = False
  precision: str | None = None


def check(operation, operands, labels, request: Request, *, vocab_axis, mesh=None,
          batch_axis=None):
  """``(Options, operands)`` of a call after its checks; the operands come back as arrays
  (a fused call's ``(hidden, weight, bias or None)``: the bias from the request).

  Args:
    operation: the public operation, a ``jaxce._kernels.config.Operation`` record.
    operands: ``(logits,)`` or ``(hidden, weight)``, as arrays.
    labels: int array.
    request: the call's keyword options.
    vocab_axis: the vocabulary's mesh axis, inside ``shard_map`` when ``mesh`` is None.
    mesh, batch_axis: the mesh of a call on global arrays.
  """
  fused = operation.fused
  if fused:
    hidden, weight = operands
    _checks.check_float("hidden", hidden)
    _checks.check_float("weight", weight)
    _checks.check_weight(hidden, weight, request.weight_layout)
    vocab_dim = _checks.vocab_dim(request.weight_layout)
    num_columns, columns_name = weight.shape[vocab_dim], "weight"
    leading, leading_name = hidden.shape[:-1], "hidden.shape[:-1]"
  else:
    (logits,) = operands
    _checks.check_float("logits", logits)
    num_columns, columns_name = logits.shape[-1], "logits"
    leading, leading_name = logits.shape[:-1], "logits.shape[:-1]"
  if mesh is not None:
    shards = _checks.check_mesh(mesh, vocab_axis, batch_axis, num_columns, columns_name,
                                leading, leading_name)
    total_columns = num_columns
  else:
    shards = _checks.vocab_shards(vocab_axis)
    total_columns = num_columns * shards
    if shards > 1:
      columns_name = f"{columns_name} across {shards} shards of {vocab_axis!r}"
  _checks.check_columns("weight" if fused else "logits", num_columns)
  extra = {}
  if fused:
    if not operation.is_objective:  # (the per-token path's options)
      _checks.check_size(request.vocab_block_size, "vocab_block_size")
      _checks.check_choice("hidden_grad_accumulation", request.hidden_grad_accumulation,
                           HIDDEN_GRAD_ACCUMULATIONS)
      extra.update(vocab_block_size=request.vocab_block_size,
                   hidden_grad_accumulation=request.hidden_grad_accumulation)
    _checks.check_softcap(request.logit_softcap)
    extra.update(precision=_checks.check_precision(request.precision))
    bias = _checks.check_bias(request.bias, num_columns)
    operands = (hidden, weight, bias)
    extra.update(vocab_dim=vocab_dim, logit_softcap=(None if request.logit_softcap is None
                                                     else float(request.logit_softcap)))
  else:
    extra.update(backward_in_place=bool(request.backward_in_place))
  _checks.check_labels(labels, leading, leading_name)
  _checks.check_size(request.chunk_size, "chunk_size")
  implementation = request.implementation
  if implementation is not None:
    _checks.check_choice("implementation", implementation,
                         plan.IMPLEMENTATIONS + tuple(plan.ALIASES))
  _checks.check_temperature(request.temperature, labels.shape)
  _checks.check_where(request.where, labels.shape)
  vocab_size = _checks.check_vocab_size(request.vocab_size, total_columns, columns_name)
  _checks.check_labels_in_range(labels, request.where, vocab_size)
  _checks.check_flag("batch_invariant", request.batch_invariant)
  if request.batch_invariant and total_columns > softmax.MAX_EXACT_COLUMNS:
    raise ValueError(f"batch_invariant=True sums at most {softmax.MAX_EXACT_COLUMNS} "
                     f"columns exactly; {columns_name} has {total_columns}")
  if request.keep is not None:
    _checks.check_keep(request.keep, labels.shape, num_columns, shards,
                       local=mesh is None and shards > 1)
    extra.update(has_keep=True)
  options = Options(vocab_size=vocab_size, vocab_shards=shards,
                    return_entropy=request.return_entropy, chunk_size=request.chunk_size,
                    implementation=implementation, batch_invariant=request.batch_invariant,
                    target=plan.target(*operands[:2], mesh=mesh), **extra)
  return options, operands


def check_objective(objective, labels, token_args, dtypes, options):
  """``(token_args as arrays of the labels' shape, options with return_entropy resolved
  to whether the entropy is computed)`` of an objective call."""
  arrays = []
  for k, arg in enumerate(token_args):
    name = f"token_args[{k}]"
    arg = _checks.as_array(name, arg)
    _checks.check_broadcastable(name, arg, labels.shape)
    arrays.append(jnp.broadcast_to(arg, labels.shape))
  dtype = softmax.compute_dtype(*dtypes)
  uses_entropy = _checks.check_objective(objective, 8, arrays, dtype)
  if options.return_entropy is False and uses_entropy:
    raise ValueError("return_entropy=False, but the objective uses the entropy")
  with_entropy = uses_entropy or bool(options.return_entropy)
  return arrays, dataclasses.replace(options, return_entropy=with_entropy)
