"""GRPO training steps on one device, on a data x vocab mesh (``jit`` + ``shard_map``) and
under ``pmap``; host-side batches and placement that also work across processes.

Parameters live in an ``nnx.Param`` state (a pytree) and are updated with plain optax.
On a mesh every array is global: the batch is split over ``"data"``, the LM head kernel's
vocabulary columns over ``"vocab"``, every other parameter is replicated. With
``GRPOConfig.sequence_parallel`` (the layout sequence parallelism leaves, as Megatron runs
it) the batch is split over ``"data"`` and ``"vocab"`` together, and the token embedding's
rows over ``"vocab"`` like the LM head's columns.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from examples.loss import DATA, VOCAB, Batch, GRPOConfig, completion_mask, group_advantages
from examples.loss import grpo_loss, policy_logprobs, token_axes


def make_optimizer(name: str = "adam", learning_rate: float = 1e-3):
  """``optax.adam`` or ``optax.sgd``."""
  return {"adam": optax.adam, "sgd": optax.sgd}[name](learning_rate)


def make_mesh(data: int, vocab: int, devices=None) -> Mesh:
  """A ``(data, vocab)`` mesh over ``devices`` (default: all devices of all processes).

  Rows are consecutive devices, so with several processes the ``vocab`` groups stay inside
  a process (fast links) and ``data`` spans processes; pass ``devices`` to choose otherwise.
  """
  devices = np.asarray(jax.devices() if devices is None else devices)
  if devices.size != data * vocab:
    raise ValueError(f"a {data} x {vocab} mesh needs {data * vocab} devices, got {devices.size}")
  return Mesh(devices.reshape(data, vocab), (DATA, VOCAB))


def param_shardings(params, mesh: Mesh, *, split_embedding: bool = False):
  """``NamedSharding`` per parameter: the LM head kernel ``[D, V]`` split over ``vocab``,
  with ``split_embedding`` the token embedding's ``[V, D]`` rows too (Megatron's
  vocab-parallel embedding: a lookup sums the devices' masked rows), everything else
  replicated."""
  def sharding(path, _):
    names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    spec = P()
    if {"lm_head", "kernel"} <= names:
      spec = P(None, VOCAB)
    elif split_embedding and {"embed", "embedding"} <= names:
      spec = P(VOCAB, None)
    return NamedSharding(mesh, spec)
  return jax.tree_util.tree_map_with_path(sharding, params)


def put_global(tree, shardings):
  """Host (numpy) arrays -> global ``jax.Array`` s; every process passes the same values and
  each keeps only the shards of its own devices."""
  def put(x, sharding):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
  return jax.tree.map(put, tree, shardings)


def to_host(tree):
  """Global arrays -> numpy on every process (an all-gather when not fully addressable)."""
  def get(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(get, tree)


def train_step(params, opt_state, batch, *, graphdef, cfg: GRPOConfig, optimizer, mesh=None,
               pmap_axis=None):
  """One optimizer step: ``(params, opt_state, metrics)``.

  With ``pmap_axis`` (inside ``jax.pmap``) gradients and metrics are ``pmean``-ed over it;
  the loss is a mean over sequences, so the mean of equal shards is the full-batch loss.
  """
  grads, metrics = jax.grad(grpo_loss, has_aux=True)(params, graphdef, batch, cfg, mesh)
  if pmap_axis is not None:
    grads, metrics = jax.lax.pmean((grads, metrics), pmap_axis)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, metrics


class Runner:
  """Compiled GRPO functions and array placement for one layout.

  One device (default); ``mesh``: global arrays on a ``(data, vocab)`` mesh, any number of
  processes, the jaxce paths inside ``shard_map``; ``pmap``: data parallel over the local
  devices, every array with a leading device axis, gradients ``pmean``-ed.

  Attributes:
    score: ``(params, tokens, mask)`` -> no-gradient log-probs ``[B, S-1]``.
    step: ``(params, opt_state, batch)`` -> ``(params, opt_state, metrics)``; donates the
      params and the optimizer state.
  """

  def __init__(self, graphdef, cfg: GRPOConfig, optimizer, *, mesh=None, pmap=False):
    if mesh is not None and pmap:
      raise ValueError("pass a mesh or pmap=True, not both")
    self.mesh, self.pmap, self.optimizer = mesh, pmap, optimizer
    self.sequence_parallel = cfg.sequence_parallel
    self.row_axes = token_axes(mesh, cfg.sequence_parallel)
    self.devices = jax.local_device_count() if pmap else 1
    self.score = self.compile(partial(policy_logprobs, graphdef=graphdef, cfg=cfg, mesh=mesh))
    self.step = self.compile(
        partial(train_step, graphdef=graphdef, cfg=cfg, optimizer=optimizer, mesh=mesh,
                pmap_axis=DATA if pmap else None), donate_argnums=(0, 1))
    self._init = self.compile(optimizer.init)

  def compile(self, fn, donate_argnums=()):
    """``jax.pmap`` (axis ``"data"``) or ``jax.jit`` of ``fn``, as the layout needs."""
    if self.pmap:
      return jax.pmap(fn, axis_name=DATA, donate_argnums=donate_argnums)
    return jax.jit(fn, donate_argnums=donate_argnums)

  def init(self, params):
    """Optimizer state for (placed) ``params``; on a mesh each leaf is sharded like its
    parameter (a jitted ``init`` alone would put its constant zeros on one device)."""
    if self.mesh is None:
      return self._init(params)
    shardings = optax.tree_map_params(
        self.optimizer, lambda _, sharding: sharding,
        jax.eval_shape(self.optimizer.init, params), jax.tree.map(lambda x: x.sharding, params),
        transform_non_params=lambda _: NamedSharding(self.mesh, P()))
    return jax.jit(self.optimizer.init, out_shardings=shardings)(params)

  def param_shardings(self, params):
    """:func:`param_shardings` of this layout (a mesh's; with ``cfg.sequence_parallel``
    the token embedding's rows split over ``vocab`` too)."""
    return param_shardings(params, self.mesh, split_embedding=self.sequence_parallel)

  def place_params(self, params):
    """Host ``nnx.Param`` state -> device arrays for this layout."""
    if self.mesh is not None:
      return put_global(params, self.param_shardings(params))
    if self.pmap:
      return jax.tree.map(lambda x: np.broadcast_to(x, (self.devices,) + x.shape), params)
    return jax.tree.map(jax.numpy.asarray, params)

  def place_rows(self, *arrays):
    """Host ``[B, ...]`` arrays -> split by rows over ``data`` (with
    ``cfg.sequence_parallel``: over ``data`` and ``vocab``; or over the pmap devices)."""
    if self.mesh is not None:
      return tuple(put_global(x, NamedSharding(self.mesh, P(self.row_axes))) for x in arrays)
    if self.pmap:
      return tuple(np.reshape(x, (self.devices, -1) + np.shape(x)[1:]) for x in arrays)
    return tuple(jax.numpy.asarray(x) for x in arrays)

  def to_host(self, tree):
    """Device arrays -> numpy on every process (pmap: the device axis merged into rows)."""
    tree = to_host(tree)
    if self.pmap:
      tree = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)
    return tree

  def host_params(self, params):
    """Device params -> host numpy (for pmap, device 0's copy)."""
    tree = to_host(params)
    return jax.tree.map(lambda x: x[0], tree) if self.pmap else tree

  def batch(self, params, ref_params, tokens, mask, advantages) -> Batch:
    """Placed rollouts + their log-probs under the current (old) and reference policies."""
    return Batch(tokens, mask, advantages, self.score(params, tokens, mask),
                 self.score(ref_params, tokens, mask))


def synthetic_rollouts(seed: int, *, num_prompts: int, group_size: int, seq_len: int,
                       vocab_size: int):
  """A batch as a sampler would return it, on the host: ``(tokens, mask, advantages)``.

  ``B = num_prompts * group_size`` sequences ``[prompt | completion | padding (id 0)]``;
  the ``group_size`` samples of a prompt share it, prompts and completions have random
  lengths, rewards are random. Returns int32 ``[B, S]``, bool ``[B, S-1]``, float32 ``[B]``.
  """
  rng = np.random.default_rng(seed)
  batch = num_prompts * group_size
  tokens = rng.integers(1, vocab_size, (batch, seq_len), dtype=np.int32)
  tokens[:, :seq_len // 2] = np.repeat(tokens[::group_size, :seq_len // 2], group_size, axis=0)
  prompt_lengths = np.repeat(rng.integers(1, seq_len // 2 + 1, num_prompts), group_size)
  completion_lengths = rng.integers(1, seq_len - prompt_lengths + 1)
  tokens[np.arange(seq_len) >= (prompt_lengths + completion_lengths)[:, None]] = 0
  mask = np.asarray(completion_mask(prompt_lengths, completion_lengths, seq_len))
  advantages = np.asarray(group_advantages(rng.normal(size=batch), group_size))
  return tokens, mask, advantages


def train_on_rollouts(graphdef, params, ref_params, rollouts, *, cfg: GRPOConfig, optimizer,
                      num_steps: int, mesh=None, pmap=False):
  """GRPO's inner loop on one batch: score it with the current (old) and reference policies
  without gradient, then ``num_steps`` updates on it (the ratio moves away from 1).

  Args:
    graphdef: the model's graph definition.
    params, ref_params: host (numpy) ``nnx.Param`` states of the policy and the reference.
    rollouts: host ``(tokens, mask, advantages)``, e.g. :func:`synthetic_rollouts`.
    cfg, optimizer: the loss options and an optax optimizer.
    num_steps: updates.
    mesh: run on this ``(data, vocab)`` mesh (any number of processes).
    pmap: run data-parallel with ``jax.pmap`` over all local devices instead.

  Returns:
    ``(params, metrics)``: the final parameters on the host (every process) and one dict of
    floats per step.
  """
  runner = Runner(graphdef, cfg, optimizer, mesh=mesh, pmap=pmap)
  params = runner.place_params(params)
  batch = runner.batch(params, runner.place_params(ref_params), *runner.place_rows(*rollouts))
  opt_state = runner.init(params)
  history = []
  for _ in range(num_steps):
    params, opt_state, metrics = runner.step(params, opt_state, batch)
    history.append({k: float(np.ravel(v)[0]) for k, v in to_host(metrics).items()})
  return runner.host_params(params), history
