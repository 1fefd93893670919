"""The front door: every public function checks its arguments here, once, and runs in one
of two ways.

* On this device's arrays (also inside the caller's ``shard_map`` / ``pmap``, where
  ``vocab_axis`` names the axis the vocabulary is split over): ``_logits_shard`` /
  ``_linear_shard`` flatten the tokens, plan the tiles (``jaxce.plan``) and call the
  kernel (``_logits`` / ``_linear``).
* On global arrays over a mesh (the ``sharded_*`` functions, or arrays whose types split
  them over a mesh's explicit axes): ``_sharded.run`` wraps the same per-shard function in
  ``shard_map``.

Kernels import neither this module nor ``_sharded``; ``_sharded`` imports no kernel.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxce import (_checks, _linear, _linear_token_loss, _logits, _math, _mosaic_linear,
                   _objective, _sharded, _token_loss, plan)

_HIDDEN_GRAD_ACCUMULATIONS = ("float32", "output")


def logprobs_and_entropy(logits, labels, *, temperature=1.0, where=None, vocab_size=None,
                         chunk_size=None, vocab_axis=None, return_entropy=True,
                         implementation=None, backward_in_place=False):
  """Per-token log-probability of the label and entropy of softmax(logits / temperature).

  Args:
    logits: ``[..., V]`` bf16, f16 or f32 (``V = V_local``, this shard's columns, when
      ``vocab_axis`` is set).
    labels: int ``[...]``, global token ids. Negative ids are ignored.
    temperature: float > 0 or float array broadcastable to ``labels.shape``. No gradient.
    where: optional bool array broadcastable to ``labels.shape``; False positions are
      ignored. Ignored positions give log-prob 0, entropy 0 and an exactly zero gradient.
    vocab_size: logical vocabulary when the columns are padded; global column ids
      ``>= vocab_size`` are excluded from the softmax. A kept label ``>= vocab_size`` is a
      ``ValueError`` for concrete inputs and a NaN log-prob under ``jit``.
    chunk_size: tokens per step of the XLA forward's scan and of the
      ``backward_in_place`` loop; ``None`` plans one (``jaxce.plan.logits_chunk``);
      ``>= T`` runs a single pass. The Pallas forward (the GPU default) reads every row in
      one pass and the default backward is one pass: there it is not used (and a new
      value does not recompile).
    vocab_axis: mesh axis name (or tuple) the last dim is split over, when called inside
      ``shard_map`` / ``pmap``. Shard k holds ids ``[k * V_local, (k + 1) * V_local)``.
    return_entropy: when False the entropy is neither computed nor returned (``None``).
    implementation: forward statistics by ``"xla"`` (two fused passes per chunk of
      tokens) or ``"pallas"`` (one pass, a Triton kernel; interpreted off GPUs, for
      tests). ``None``: as ``jaxce.plan.implementation`` decides (``"pallas"`` on GPUs
      unless the logits are float64, inside ``shard_map`` too).
    backward_in_place: ``False`` (default): one fused pass writes the gradient; donated
      logits are reused by XLA, but as an intermediate of a jitted step XLA's GPU plan
      gives the gradient its own buffer. ``True``: the backward walks the logits in
      chunks of tokens and overwrites each chunk with its gradient, so when the logits
      are dead afterwards (donated, or an intermediate of a jitted training step) the
      gradient takes their buffer; when they are still alive XLA copies them first (one
      more read and write of the logits, no more memory). On GPUs this loop runs slower
      than the fused pass (bench/NOTES.md, entry 10).

  Returns:
    ``(logp, entropy)``, float32 arrays of ``labels.shape`` (entropy ``None`` when
    ``return_entropy=False``).

  Memory: the forward keeps the logits plus three ``[T]`` vectors as residuals; its working
  set is O(T) with the Pallas kernel and the reductions' partial sums of one
  ``[chunk, V_local]`` tile with XLA. The backward reads the logits once and writes the
  gradient (an array like ``logits``) with no temporaries; see ``backward_in_place`` for
  when that array is the logits' own buffer.
  """
  logits = _checks.as_array("logits", logits)
  labels = _checks.as_array("labels", labels)
  options = dict(temperature=temperature, where=where, vocab_size=vocab_size,
                 chunk_size=chunk_size, return_entropy=return_entropy,
                 implementation=implementation, backward_in_place=backward_in_place)
  split = None if vocab_axis is not None else _sharded.logits_split(
      logits, labels, where, temperature)
  if split is not None:  # split over a mesh's explicit axes: as their types say
    mesh, vocab_axis, token_entries = split
    return _logits_on_mesh(logits, labels, mesh, vocab_axis, None, token_entries, options)
  options = _check_local_logits(logits, labels, vocab_axis, options)
  return _logits_shard(logits, labels=labels, vocab_axis=vocab_axis, **options)


def sharded_logprobs_and_entropy(logits, labels, *, mesh, vocab_axis, batch_axis=None, **kw):
  """:func:`jaxce.logprobs_and_entropy` on global arrays over ``mesh``.

  Args:
    logits: global ``[B, ..., V]``; the last dim is split over ``vocab_axis`` and, with
      ``batch_axis``, the first dim over ``batch_axis``. V must divide by the shard count.
    labels: global int ``[B, ...]`` of global ids.
    mesh: a ``jax.sharding.Mesh``.
    vocab_axis, batch_axis: mesh axis names (or tuples of names).
    **kw: any keyword of :func:`jaxce.logprobs_and_entropy` but ``vocab_axis``; array
      ``temperature`` and ``where`` are broadcast to ``labels.shape`` and split like the
      labels.

  Returns:
    ``(logp, entropy)`` global float32 arrays of ``labels.shape``, split like the labels.
  """
  logits = _checks.as_array("logits", logits)
  labels = _checks.as_array("labels", labels)
  options = _options(logprobs_and_entropy, kw)
  return _logits_on_mesh(logits, labels, mesh, vocab_axis, batch_axis,
                         _sharded.token_spec(logits.ndim - 1, batch_axis), options)


def linear_logprobs_and_entropy(hidden, weight, labels, *, bias=None, logit_softcap=None,
                                temperature=1.0, where=None, vocab_size=None, chunk_size=None,
                                vocab_axis=None, return_entropy=True, vocab_block_size=None,
                                weight_layout="dv", implementation=None,
                                hidden_grad_accumulation="float32"):
  """Per-token log-prob and entropy of ``softmax(softcap(hidden @ weight + bias) / T)``.

  Args:
    hidden: ``[..., D]`` bf16, f16 or f32.
    weight: ``[D, V]`` (``V = V_local`` with ``vocab_axis``), a Flax ``Linear`` kernel;
      or ``[V, D]`` with ``weight_layout="vd"``.
    labels: int ``[...]`` = ``hidden.shape[:-1]``, global ids; negative ids are ignored.
    bias: optional ``[V]``.
    logit_softcap: optional float c > 0: logits become ``c * tanh(logits / c)`` before the
      temperature (Gemma 2 style).
    temperature, where, vocab_size, vocab_axis, return_entropy: as in
      :func:`jaxce.logprobs_and_entropy`.
    chunk_size: tokens per tile; ``None`` plans it (``jaxce.plan.linear_tiles``: an f32
      tile budget per backend).
    vocab_block_size: vocab columns per tile; ``None``: ``min(V, 8192)``.
    weight_layout: ``"dv"`` (``weight`` is ``[D, V]``) or ``"vd"`` (``[V, D]``: tied
      embeddings pass the embedding table itself). Either way the matmuls read the array
      as stored; passing ``embedding.T`` with ``"dv"`` also works but XLA may then copy
      the table and the gradient into the other layout.
    implementation: the forward's statistics of each f32 tile by ``"xla"`` (two fused
      passes over the tile: the max, then the sums) or ``"pallas"`` (one pass, the
      Triton kernel of the logits path; interpreted off GPUs, for tests), or the whole
      forward by ``"mosaic"``: one Mosaic GPU kernel (Hopper, sm90) that folds each tile
      of the matmul into the statistics in registers, so no f32 tile reaches device
      memory; for 16-bit ``hidden`` and ``weight`` of one dtype, no bias, ``D`` a
      multiple of 64, a vocabulary per device that is a multiple of 128 and at least 256
      tokens (a ``ValueError`` says which is missing); interpreted off GPUs, for tests.
      ``None``: ``"mosaic"`` on a Hopper GPU where it can run, else as
      ``jaxce.plan.implementation`` decides.
    hidden_grad_accumulation: where the backward sums ``d hidden`` over the vocab blocks
      (and shards). ``"float32"`` (default): an f32 ``[T, D]`` buffer, rounded to
      ``hidden``'s dtype once at the end. ``"output"``: in ``d hidden`` itself, in
      ``hidden``'s dtype, so no f32 ``[T, D]`` buffer exists (``4 T D`` bytes less; with
      the vocabulary split over GPUs it is the largest buffer that does not shrink with
      their number), at the price of one rounding per vocab block of each shard and one
      per shard in the all-reduce (bench/NOTES.md, entry 18, has the measured error). The
      same as ``"float32"`` for float32 ``hidden``.

  Returns:
    ``(logp, entropy)`` float32 of ``labels.shape`` (entropy ``None`` when
    ``return_entropy=False``). Gradients flow to ``hidden``, ``weight`` and ``bias`` in
    their own dtypes.

  Dtypes: the matmuls take ``hidden`` and ``weight`` in their common dtype, as
  ``hidden @ weight`` does (bf16 hidden with an f32 kernel: f32 matmuls, like the
  reference). Each tile is cast on the fly; no converted copy of either array is made.
  For bf16 matmuls with f32 parameters, pass ``kernel.astype(jnp.bfloat16)`` (what Flax's
  ``Linear(dtype=jnp.bfloat16)`` does); its gradient then comes back in f32 through the cast.

  Memory: no ``[T, V]`` array. Forward: two f32 ``[chunk, Vb]`` tiles, the weight block
  being read and O(T). Backward: ``d hidden`` and ``d weight`` (the outputs), two f32
  tiles, and the smaller of (``jaxce.plan.linear_backward_order``) an f32 ``[T, D]``
  accumulator for ``d hidden`` with an f32 ``[D, Vb]`` one for the weight block (none of
  the first with ``hidden_grad_accumulation="output"``), or an f32 accumulator like the
  weight with an f32 ``[chunk, D]`` one: past ``V_local`` tokens, flat in T.
  """
  hidden = _checks.as_array("hidden", hidden)
  weight = _checks.as_array("weight", weight)
  labels = _checks.as_array("labels", labels)
  options = dict(bias=bias, logit_softcap=logit_softcap, temperature=temperature, where=where,
                 vocab_size=vocab_size, chunk_size=chunk_size, return_entropy=return_entropy,
                 vocab_block_size=vocab_block_size, weight_layout=weight_layout,
                 implementation=implementation,
                 hidden_grad_accumulation=hidden_grad_accumulation)
  split = None if vocab_axis is not None else _sharded.linear_split(
      hidden, weight, labels, _checks.vocab_dim(weight_layout), bias, where, temperature)
  if split is not None:  # split over a mesh's explicit axes: as their types say
    mesh, vocab_axis, token_entries = split
    return _linear_on_mesh(hidden, weight, labels, mesh, vocab_axis, None, token_entries,
                           options)
  options = _check_local_linear(hidden, weight, labels, vocab_axis, options)
  return _linear_shard(hidden, weight, options.pop("bias"), labels=labels,
                       vocab_axis=vocab_axis, **options)


def sharded_linear_logprobs_and_entropy(hidden, weight, labels, *, mesh, vocab_axis,
                                        batch_axis=None, **kw):
  """:func:`jaxce.linear_logprobs_and_entropy` on global arrays over ``mesh``.

  Args:
    hidden: global ``[B, ..., D]``, the first dim split over ``batch_axis`` if given.
    weight: global ``[D, V]`` (``[V, D]`` with ``weight_layout="vd"``), the vocab split
      over ``vocab_axis``; ``bias`` (in ``kw``) ``[V]`` likewise.
    labels: global int ``[B, ...]``.
    **kw: any keyword of :func:`jaxce.linear_logprobs_and_entropy` but ``vocab_axis``.

  Returns:
    ``(logp, entropy)`` global float32 arrays of ``labels.shape``. ``d hidden`` is
    reduced over ``vocab_axis`` inside; ``d weight`` stays split.
  """
  hidden = _checks.as_array("hidden", hidden)
  weight = _checks.as_array("weight", weight)
  labels = _checks.as_array("labels", labels)
  options = _options(linear_logprobs_and_entropy, kw)
  return _linear_on_mesh(hidden, weight, labels, mesh, vocab_axis, batch_axis,
                         _sharded.token_spec(hidden.ndim - 1, batch_axis), options)


def token_loss(objective, logits, labels, *token_args, temperature=1.0, where=None,
               vocab_size=None, chunk_size=None, vocab_axis=None, return_entropy=None,
               implementation=None):
  """``sum`` over kept tokens of ``objective(logp, entropy, *token_args)``, with its
  gradient formed in the forward pass.

  Args:
    objective: ``(logp, entropy, *token_args) -> terms``, all of one shape: a token's term
      must depend on that token's values alone (elementwise: no mean, sum, sort or matmul
      over tokens; a ``ValueError`` says so). Normalizations are per-token weights among
      ``token_args`` (``jaxce.objectives.token_weights``). Built-ins: ``jaxce.objectives``.
    logits, labels, temperature, where, vocab_size, chunk_size, vocab_axis,
      implementation: as in :func:`jaxce.logprobs_and_entropy`.
    *token_args: arrays broadcastable to ``labels.shape`` (advantages, old and reference
      log-probs, weights...); no gradient flows to them.
    return_entropy: ``None``: the entropy is computed (and returned) when the objective
      uses it; ``True``: also for metrics when it does not; ``False``: never (an objective
      that uses it is a ``ValueError``).

  Returns:
    ``(loss, (logp, entropy))``: the float32 scalar loss and, under ``stop_gradient``, the
    per-token log-probs and entropies of ``labels.shape`` (entropy ``None`` when not
    computed). Ignored tokens contribute nothing and get an exactly zero gradient,
    whatever the objective returns for them.

  Under ``jax.grad`` the forward computes the loss and ``d logits``: two passes over the
  logits (the statistics; one elementwise pass that writes the gradient); the backward
  only scales it by the loss's cotangent. Without differentiation no gradient work is
  done. Memory: the gradient (an array like ``logits``) and O(T).
  """
  logits = _checks.as_array("logits", logits)
  labels = _checks.as_array("labels", labels)
  options = dict(temperature=temperature, where=where, vocab_size=vocab_size,
                 chunk_size=chunk_size, return_entropy=return_entropy,
                 implementation=implementation)
  split = None if vocab_axis is not None else _sharded.logits_split(
      logits, labels, where, temperature, *token_args)
  if split is not None:  # split over a mesh's explicit axes: as their types say
    mesh, vocab_axis, token_entries = split
    return _token_loss_on_mesh(objective, logits, labels, token_args, mesh, vocab_axis, None,
                               token_entries, options)
  options = _check_local_logits(logits, labels, vocab_axis, options)
  token_args, options = _check_objective(objective, labels, token_args, logits.dtype, options)
  return _token_loss_shard(objective, logits, *token_args, labels=labels,
                           vocab_axis=vocab_axis, **options)


def linear_token_loss(objective, hidden, weight, labels, *token_args, bias=None,
                      logit_softcap=None, temperature=1.0, where=None, vocab_size=None,
                      chunk_size=None, vocab_axis=None, return_entropy=None,
                      weight_layout="dv", implementation=None):
  """:func:`jaxce.token_loss` of ``softcap(hidden @ weight + bias)``, three matmuls for
  the loss and all its gradients.

  Args:
    objective, token_args, return_entropy: as in :func:`jaxce.token_loss`.
    hidden, weight, labels, bias, logit_softcap, temperature, where, vocab_size,
      vocab_axis, weight_layout, implementation: as in
      :func:`jaxce.linear_logprobs_and_entropy`.
    chunk_size: tokens per step, whose full ``[chunk, V]`` f32 rows are held at once;
      ``None`` plans it (``jaxce.plan.linear_objective_chunk``).

  Returns:
    ``(loss, (logp, entropy))`` as :func:`jaxce.token_loss`.

  Under ``jax.grad`` one pass over chunks of tokens computes, per chunk, ``hidden @ W``
  (matmul 1), the loss terms and each token's cotangent, ``d hidden = d @ Wᵀ`` (2) and
  ``d W += hiddenᵀ @ d`` (3); the backward only scales them. Memory: ``d hidden``,
  ``d weight``, an f32 ``[D, V]`` accumulator for ``d weight`` and one chunk's rows; no
  ``[T, V]`` array and nothing else that grows with T.
  """
  hidden = _checks.as_array("hidden", hidden)
  weight = _checks.as_array("weight", weight)
  labels = _checks.as_array("labels", labels)
  options = dict(bias=bias, logit_softcap=logit_softcap, temperature=temperature, where=where,
                 vocab_size=vocab_size, chunk_size=chunk_size, return_entropy=return_entropy,
                 weight_layout=weight_layout, implementation=implementation)
  split = None if vocab_axis is not None else _sharded.linear_split(
      hidden, weight, labels, _checks.vocab_dim(weight_layout), bias, where, temperature,
      *token_args)
  if split is not None:  # split over a mesh's explicit axes: as their types say
    mesh, vocab_axis, token_entries = split
    return _linear_token_loss_on_mesh(objective, hidden, weight, labels, token_args, mesh,
                                      vocab_axis, None, token_entries, options)
  options = _check_local_linear(hidden, weight, labels, vocab_axis, options)
  token_args, options = _check_objective(
      objective, labels, token_args, jnp.promote_types(hidden.dtype, weight.dtype), options)
  return _linear_token_loss_shard(objective, hidden, weight, options.pop("bias"), *token_args,
                                  labels=labels, vocab_axis=vocab_axis, **options)


def sharded_token_loss(objective, logits, labels, *token_args, mesh, vocab_axis,
                       batch_axis=None, **kw):
  """:func:`jaxce.token_loss` on global arrays over ``mesh`` (as
  :func:`jaxce.sharded_logprobs_and_entropy`; ``token_args`` are split like the labels).
  The loss sums over every shard's tokens."""
  logits = _checks.as_array("logits", logits)
  labels = _checks.as_array("labels", labels)
  options = _options(token_loss, kw)
  return _token_loss_on_mesh(objective, logits, labels, token_args, mesh, vocab_axis,
                             batch_axis, _sharded.token_spec(logits.ndim - 1, batch_axis),
                             options)


def sharded_linear_token_loss(objective, hidden, weight, labels, *token_args, mesh,
                              vocab_axis, batch_axis=None, **kw):
  """:func:`jaxce.linear_token_loss` on global arrays over ``mesh`` (as
  :func:`jaxce.sharded_linear_logprobs_and_entropy`; ``token_args`` are split like the
  labels). The loss sums over every shard's tokens."""
  hidden = _checks.as_array("hidden", hidden)
  weight = _checks.as_array("weight", weight)
  labels = _checks.as_array("labels", labels)
  options = _options(linear_token_loss, kw)
  return _linear_token_loss_on_mesh(objective, hidden, weight, labels, token_args, mesh,
                                    vocab_axis, batch_axis,
                                    _sharded.token_spec(hidden.ndim - 1, batch_axis), options)


# --- checks (once per call) ---------------------------------------------------------------

def _options(function, kw):
  """The keyword options of ``function`` with ``kw`` applied: a TypeError names an unknown
  one (the wrappers take them as ``**kw``)."""
  defaults = {k: v for k, v in function.__kwdefaults__.items() if k != "vocab_axis"}
  unknown = sorted(set(kw) - set(defaults))
  if unknown:
    raise TypeError(f"{function.__name__} got unexpected keyword argument(s) {unknown}")
  return {**defaults, **kw}


def _check_common(labels, leading_shape, leading_name, total_columns, columns_name, options):
  """The checks both paths share; returns ``options`` with ``vocab_size`` resolved."""
  _checks.check_labels(labels, leading_shape, leading_name)
  _checks.check_size(options["chunk_size"], "chunk_size")
  if options["implementation"] is not None:
    _checks.check_choice("implementation", options["implementation"], plan.IMPLEMENTATIONS)
  _checks.check_temperature(options["temperature"], labels.shape)
  _checks.check_where(options["where"], labels.shape)
  vocab_size = _checks.check_vocab_size(options["vocab_size"], total_columns, columns_name)
  _checks.check_labels_in_range(labels, options["where"], vocab_size)
  return dict(options, vocab_size=vocab_size)


def _check_logits(logits, labels, total_columns, columns_name, options):
  _checks.check_columns("logits", logits.shape[-1])
  return _check_common(labels, logits.shape[:-1], "logits.shape[:-1]", total_columns,
                       columns_name, options)


def _check_local_logits(logits, labels, vocab_axis, options):
  """The checks of a call on this device's logits (``V_local`` columns a shard)."""
  _checks.check_float("logits", logits)
  shards = _checks.vocab_shards(vocab_axis)
  return _check_logits(
      logits, labels, logits.shape[-1] * shards,
      "logits" if shards == 1 else f"logits across {shards} shards of {vocab_axis!r}", options)


def _check_local_linear(hidden, weight, labels, vocab_axis, options):
  """The checks of a call on this device's hidden states and weight shard."""
  _check_linear_arrays(hidden, weight)
  shards = _checks.vocab_shards(vocab_axis)
  return _check_linear(
      hidden, weight, labels, shards,
      "weight" if shards == 1 else f"weight across {shards} shards of {vocab_axis!r}", options)


def _check_linear_arrays(hidden, weight):
  _checks.check_float("hidden", hidden)
  _checks.check_float("weight", weight)


def _check_linear(hidden, weight, labels, shards, columns_name, options):
  """The fused path's checks; returns the options with ``bias`` an array and
  ``vocab_size`` resolved (``shards`` vocab shards of the weight's columns)."""
  _checks.check_weight(hidden, weight, options["weight_layout"])
  num_columns = weight.shape[_checks.vocab_dim(options["weight_layout"])]
  _checks.check_columns("weight", num_columns)
  if "vocab_block_size" in options:  # (not options of the objective path)
    _checks.check_size(options["vocab_block_size"], "vocab_block_size")
    _checks.check_choice("hidden_grad_accumulation", options["hidden_grad_accumulation"],
                         _HIDDEN_GRAD_ACCUMULATIONS)
  _checks.check_softcap(options["logit_softcap"])
  options = dict(options, bias=_checks.check_bias(options["bias"], num_columns))
  return _check_common(labels, hidden.shape[:-1], "hidden.shape[:-1]", num_columns * shards,
                       columns_name, options)


def _check_objective(objective, labels, token_args, dtype, options):
  """``(token_args as arrays of the labels' shape, options with return_entropy resolved
  to whether the entropy is computed)``."""
  arrays = []
  for k, arg in enumerate(token_args):
    name = f"token_args[{k}]"
    arg = _checks.as_array(name, arg)
    _checks.check_broadcastable(name, arg, labels.shape)
    arrays.append(jnp.broadcast_to(arg, labels.shape))
  uses_entropy = _objective.check_objective(objective, 8, arrays, _math.compute_dtype(dtype))
  if options["return_entropy"] is False and uses_entropy:
    raise ValueError("return_entropy=False, but the objective uses the entropy")
  with_entropy = uses_entropy or bool(options["return_entropy"])
  return arrays, dict(options, return_entropy=with_entropy)


def _token_loss_on_mesh(objective, logits, labels, token_args, mesh, vocab_axis, batch_axis,
                        token_entries, options):
  options = _check_logits_on_mesh(logits, labels, mesh, vocab_axis, batch_axis, options)
  token_args, options = _check_objective(objective, labels, token_args, logits.dtype, options)
  token_arrays, options = _logits_mesh_inputs(logits, labels, mesh, token_args, options)
  axes = _sharded.token_axes(token_entries)

  def shard_fn(x, labels, **token):
    args = [token.pop(f"arg{k}") for k in range(len(token_args))]
    loss, (logp, entropy) = _token_loss_shard(objective, x, *args, labels=labels,
                                              vocab_axis=vocab_axis, **options, **token)
    return (lax.psum(loss, axes) if axes else loss), logp, entropy

  out = _sharded.run(shard_fn, (logits,), (P(*token_entries, vocab_axis),), token_arrays, mesh,
                     token_entries, ("scalar",) + _token_kinds(options))
  return out[0], _per_token_outputs(out[1:])


def _linear_token_loss_on_mesh(objective, hidden, weight, labels, token_args, mesh, vocab_axis,
                               batch_axis, token_entries, options):
  options = _check_linear_on_mesh(hidden, weight, labels, mesh, vocab_axis, batch_axis, options)
  token_args, options = _check_objective(
      objective, labels, token_args, jnp.promote_types(hidden.dtype, weight.dtype), options)
  arrays, specs, token_arrays, options = _linear_mesh_inputs(
      hidden, weight, labels, mesh, vocab_axis, token_entries, token_args, options)
  axes = _sharded.token_axes(token_entries)

  def shard_fn(h, w, *b, labels, **token):
    args = [token.pop(f"arg{k}") for k in range(len(token_args))]
    loss, (logp, entropy) = _linear_token_loss_shard(
        objective, h, w, b[0] if b else None, *args, labels=labels, vocab_axis=vocab_axis,
        **options, **token)
    return (lax.psum(loss, axes) if axes else loss), logp, entropy

  out = _sharded.run(shard_fn, arrays, specs, token_arrays, mesh, token_entries,
                     ("scalar",) + _token_kinds(options))
  return out[0], _per_token_outputs(out[1:])


def _logits_on_mesh(logits, labels, mesh, vocab_axis, batch_axis, token_entries, options):
  options = _check_logits_on_mesh(logits, labels, mesh, vocab_axis, batch_axis, options)
  token_arrays, options = _logits_mesh_inputs(logits, labels, mesh, (), options)
  return _per_token_outputs(_sharded.run(
      lambda x, **token: _logits_shard(x, vocab_axis=vocab_axis, **options, **token),
      (logits,), (P(*token_entries, vocab_axis),), token_arrays, mesh, token_entries,
      _token_kinds(options)))


def _linear_on_mesh(hidden, weight, labels, mesh, vocab_axis, batch_axis, token_entries,
                    options):
  options = _check_linear_on_mesh(hidden, weight, labels, mesh, vocab_axis, batch_axis, options)
  arrays, specs, token_arrays, options = _linear_mesh_inputs(
      hidden, weight, labels, mesh, vocab_axis, token_entries, (), options)

  def shard_fn(h, w, *b, **token):
    return _linear_shard(h, w, b[0] if b else None, vocab_axis=vocab_axis, **options, **token)

  return _per_token_outputs(_sharded.run(shard_fn, arrays, specs, token_arrays, mesh,
                                         token_entries, _token_kinds(options)))


def _check_logits_on_mesh(logits, labels, mesh, vocab_axis, batch_axis, options):
  """The checks of a call on global logits over ``mesh``."""
  _checks.check_float("logits", logits)
  _checks.check_mesh(mesh, vocab_axis, batch_axis, logits.shape[-1], "logits",
                     logits.shape[:-1], "logits.shape[:-1]")
  return _check_logits(logits, labels, logits.shape[-1], "logits", options)


def _check_linear_on_mesh(hidden, weight, labels, mesh, vocab_axis, batch_axis, options):
  """The checks of a call on global hidden states and weight over ``mesh``."""
  _check_linear_arrays(hidden, weight)
  options = _check_linear(hidden, weight, labels, 1, "weight", options)
  _checks.check_mesh(mesh, vocab_axis, batch_axis,
                     weight.shape[_checks.vocab_dim(options["weight_layout"])], "weight",
                     hidden.shape[:-1], "hidden.shape[:-1]")
  return options


def _logits_mesh_inputs(logits, labels, mesh, token_args, options):
  """``(token arrays, options)`` of a logits call over ``mesh``: the implementation for
  the mesh's platform, and the per-token arrays (``_token_arrays``)."""
  options = dict(options, implementation=plan.implementation(options["implementation"], logits,
                                                             mesh=mesh))
  return _token_arrays(labels, token_args, options)


def _linear_mesh_inputs(hidden, weight, labels, mesh, vocab_axis, token_entries, token_args,
                        options):
  """``(arrays, specs, token arrays, options)`` of a fused call over ``mesh``: hidden split
  like the tokens, the weight (and bias) over the vocabulary, the implementation for the
  mesh's platform, and the per-token arrays (``_token_arrays``)."""
  options = dict(options, implementation=plan.implementation(options["implementation"], hidden,
                                                             weight, mesh=mesh))
  token_arrays, options = _token_arrays(labels, token_args, options)
  bias = options.pop("bias")
  arrays = (hidden, weight) + (() if bias is None else (bias,))
  weight_spec = ((vocab_axis, None) if _checks.vocab_dim(options["weight_layout"]) == 0
                 else (None, vocab_axis))
  specs = (P(*token_entries, None), P(*weight_spec), P(vocab_axis))
  return arrays, specs[:len(arrays)], token_arrays, options


def _token_kinds(options):
  return ("token", "token") if options["return_entropy"] else ("token",)


def _per_token_outputs(out):
  """``(logp, entropy or None)`` from the wrapper's outputs."""
  return out if len(out) == 2 else (out[0], None)


def _token_arrays(labels, token_args, options):
  """``({"labels": labels, ...}, options)``: the per-token arrays a shard_map splits like
  the labels (the labels, ``temperature`` / ``where`` when they are arrays, broadcast to
  the labels' shape, and the objective's ``token_args`` as ``arg0``, ``arg1``...), and the
  options without them."""
  arrays, options = {"labels": labels}, dict(options)
  for name in ("temperature", "where"):
    value = options[name]
    if value is not None and jnp.ndim(value) > 0:
      value = options.pop(name)
      value = _checks.as_array(name, value)
      arrays[name] = _checks.broadcast_token_array(value, labels.shape, value.dtype)
  arrays.update({f"arg{k}": a for k, a in enumerate(token_args)})
  return arrays, options


# --- one device's (one shard's) call on checked arguments ---------------------------------

def _without_mosaic(implementation, function):
  """``implementation`` for a path that has no Mosaic GPU kernel yet (a clear error
  for ``"mosaic"``)."""
  if implementation == "mosaic":
    raise ValueError(f'implementation="mosaic" is for linear_logprobs_and_entropy; '
                     f'{function} takes "xla", "pallas" or None')
  return implementation


def _mask_vocab(vocab_size, num_columns, vocab_axis):
  """``vocab_size`` when some of the columns (``num_columns`` a shard) lie beyond it and
  must be masked, else ``None``."""
  return vocab_size if vocab_size < num_columns * _checks.vocab_shards(vocab_axis) else None


def _logits_shard(logits, *, labels, temperature, where, vocab_size, chunk_size, vocab_axis,
                  return_entropy, implementation, backward_in_place):
  """Flatten, normalize, plan and run the logits kernel on this device's arrays."""
  dtype = _math.compute_dtype(logits.dtype)
  inv_temp = _checks.inverse_temperature(temperature, labels.shape, dtype)
  valid = _checks.valid_mask(labels, where)
  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, dtype)
    return zeros, (zeros if return_entropy else None)
  num_tokens, num_columns = labels.size, logits.shape[-1]
  implementation = _without_mosaic(plan.implementation(implementation, logits),
                                   "logprobs_and_entropy")
  in_place = bool(backward_in_place)
  uses_chunks = implementation == "xla" or in_place
  config = _logits.Config(
      vocab_size=vocab_size,
      mask_vocab=_mask_vocab(vocab_size, num_columns, vocab_axis),
      chunk=plan.logits_chunk(num_tokens, num_columns, chunk_size) if uses_chunks else None,
      vocab_axis=vocab_axis, with_entropy=return_entropy, implementation=implementation,
      in_place=in_place)
  out = _logits.logprobs_entropy(
      logits.reshape(num_tokens, num_columns), labels.reshape(-1).astype(jnp.int32),
      inv_temp.reshape(-1), valid.reshape(-1), config)
  return out[0].reshape(labels.shape), (out[1].reshape(labels.shape) if return_entropy
                                        else None)


def _linear_shard(hidden, weight, bias, *, labels, logit_softcap, temperature, where,
                  vocab_size, chunk_size, vocab_axis, return_entropy, vocab_block_size,
                  weight_layout, implementation, hidden_grad_accumulation):
  """Flatten, normalize, plan and run the fused kernel on this device's arrays."""
  vocab_dim = _checks.vocab_dim(weight_layout)
  dtype = _math.compute_dtype(hidden.dtype, weight.dtype)
  inv_temp = _checks.inverse_temperature(temperature, labels.shape, dtype)
  valid = _checks.valid_mask(labels, where)
  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, dtype)
    return zeros, (zeros if return_entropy else None)
  num_tokens, num_columns = labels.size, weight.shape[vocab_dim]
  chunk, block = plan.linear_tiles(num_tokens, num_columns, chunk_size, vocab_block_size)
  chosen = plan.implementation(implementation, hidden, weight)
  reason = _mosaic_linear.unsupported(hidden, weight, bias, num_tokens, vocab_dim)
  if implementation is None and chosen == "pallas" and reason is None:
    chosen = "mosaic"  # where it runs, the one-kernel forward is faster (NOTES, entry 21)
  if chosen == "mosaic" and reason:
    raise ValueError(f'implementation="mosaic" cannot run this call: {reason}')
  if chosen == "mosaic":
    chunk, block = plan.linear_kernel_tiles(num_tokens, num_columns, chunk_size,
                                            vocab_block_size)
  config = _linear.Config(
      vocab_size=vocab_size,
      mask_vocab=_mask_vocab(vocab_size, num_columns, vocab_axis),
      chunk=chunk, block=block, vocab_axis=vocab_axis,
      softcap=None if logit_softcap is None else float(logit_softcap),
      with_entropy=return_entropy, vocab_dim=vocab_dim,
      pallas=chosen == "pallas", mosaic=chosen == "mosaic",
      hidden_grad_in_output=hidden_grad_accumulation == "output",
      token_outer=plan.linear_backward_order(num_tokens, num_columns,
                                             hidden_grad_accumulation) == "token")
  out = _linear.logprobs_entropy(
      hidden.reshape(num_tokens, hidden.shape[-1]), weight, bias,
      labels.reshape(-1).astype(jnp.int32), inv_temp.reshape(-1), valid.reshape(-1), config)
  return out[0].reshape(labels.shape), (out[1].reshape(labels.shape) if return_entropy
                                        else None)


def _flat_token_args(token_args, shape):
  """Each token argument flattened to ``[T]``, with no gradient."""
  return tuple(lax.stop_gradient(jnp.broadcast_to(a, shape).reshape(-1)) for a in token_args)


def _token_loss_shard(objective, logits, *token_args, labels, temperature, where, vocab_size,
                      chunk_size, vocab_axis, return_entropy, implementation):
  """Flatten, normalize, plan and run the logits objective kernel on this device's arrays."""
  dtype = _math.compute_dtype(logits.dtype)
  inv_temp = _checks.inverse_temperature(temperature, labels.shape, dtype)
  valid = _checks.valid_mask(labels, where)
  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, dtype)
    return jnp.zeros((), dtype), (zeros, zeros if return_entropy else None)
  num_tokens, num_columns = labels.size, logits.shape[-1]
  pallas = _without_mosaic(plan.implementation(implementation, logits),
                           "token_loss") == "pallas"
  config = _token_loss.Config(
      vocab_size=vocab_size, mask_vocab=_mask_vocab(vocab_size, num_columns, vocab_axis),
      chunk=None if pallas else plan.logits_chunk(num_tokens, num_columns, chunk_size),
      vocab_axis=vocab_axis, with_entropy=return_entropy, pallas=pallas)
  loss, (logp, entropy) = _token_loss.token_loss(
      objective, logits.reshape(num_tokens, num_columns), labels.reshape(-1).astype(jnp.int32),
      inv_temp.reshape(-1), valid.reshape(-1), _flat_token_args(token_args, labels.shape),
      config)
  return loss, _token_outputs(logp, entropy, labels.shape)


def _linear_token_loss_shard(objective, hidden, weight, bias, *token_args, labels,
                             logit_softcap, temperature, where, vocab_size, chunk_size,
                             vocab_axis, return_entropy, weight_layout, implementation):
  """Flatten, normalize, plan and run the fused objective kernel on this device's arrays."""
  vocab_dim = _checks.vocab_dim(weight_layout)
  dtype = _math.compute_dtype(hidden.dtype, weight.dtype)
  inv_temp = _checks.inverse_temperature(temperature, labels.shape, dtype)
  valid = _checks.valid_mask(labels, where)
  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, dtype)
    return jnp.zeros((), dtype), (zeros, zeros if return_entropy else None)
  num_tokens, num_columns = labels.size, weight.shape[vocab_dim]
  config = _linear_token_loss.Config(
      vocab_size=vocab_size, mask_vocab=_mask_vocab(vocab_size, num_columns, vocab_axis),
      chunk=plan.linear_objective_chunk(num_tokens, num_columns, chunk_size),
      vocab_axis=vocab_axis, softcap=None if logit_softcap is None else float(logit_softcap),
      with_entropy=return_entropy, vocab_dim=vocab_dim,
      pallas=_without_mosaic(plan.implementation(implementation, hidden, weight),
                             "linear_token_loss") == "pallas")
  loss, (logp, entropy) = _linear_token_loss.linear_token_loss(
      objective, hidden.reshape(num_tokens, hidden.shape[-1]), weight, bias,
      labels.reshape(-1).astype(jnp.int32), inv_temp.reshape(-1), valid.reshape(-1),
      _flat_token_args(token_args, labels.shape), config)
  return loss, _token_outputs(logp, entropy, labels.shape)


def _token_outputs(logp, entropy, shape):
  """The metrics ``(logp, entropy)`` of ``shape``, under ``stop_gradient``."""
  logp = lax.stop_gradient(logp.reshape(shape))
  return logp, None if entropy is None else lax.stop_gradient(entropy.reshape(shape))
