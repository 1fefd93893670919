"""The JAX implementations, each built into one function ready for ``jax.jit``.

Every implementation computes per-token ``logp`` (and ``H`` unless log-prob only) of
``softmax(x)`` with ``x`` the logits (``input="logits"``) or ``hidden @ W``
(``input="linear"``). ``fwd`` returns ``(logp, H)``; ``fwd_bwd`` returns the value and
gradients of ``sum(adv * logp) + c * sum(H)`` with respect to the float inputs.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bench.configs import (GRPO_NOTE, IMPLEMENTATION_VARIANTS, IN_PLACE_VARIANTS,
                           KEEP_VARIANTS, KEPT_FRACTION, LOOP_VARIANTS, OBJECTIVE_VARIANTS,
                           TRAIN_STEP_VARIANTS, Config)

VOCAB_AXIS = "v"
DATA_AXIS = "d"  # (a data × vocab mesh: Config.data > 1)
# Where each input lives: the vocab dim split over the mesh, everything else replicated.
SPECS = {"logits": P(None, VOCAB_AXIS), "weight": P(None, VOCAB_AXIS), "hidden": P(),
         "labels": P(), "adv": P(), "keep": P(None, VOCAB_AXIS), "kept_token_ids": P(),
         "kept_offsets": P()}
# The kept sets' inputs of each kept-set variant (bench.inputs), after the float arrays.
KEEP_INPUTS = {"keep": ("keep",), "kept_ids": ("kept_token_ids", "kept_offsets")}
SCAN_CHUNK = 1024  # jax_scan_remat's chunk when the config gives none


@dataclasses.dataclass
class Built:
  """A configuration ready to compile.

  Attributes:
    fn: takes the arrays named in ``names``, in that order.
    names: input names (keys of :func:`bench.inputs.host_inputs`).
    donate: ``donate_argnums`` for ``jax.jit``.
    chunk_used: tokens per chunk the implementation actually uses (``None``: unchunked).
    note: anything a reader of the row must know.
  """
  fn: Callable
  names: tuple
  donate: tuple = ()
  chunk_used: Optional[int] = None
  note: str = ""


def plain_logprobs_entropy(x, labels, with_entropy=True):
  """``jax.nn.log_softmax(x.astype(f32))`` and its entropy: what users write by hand.

  Materializes ``[T, V]`` f32 arrays (and autodiff keeps them for the backward).
  """
  logp_all = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
  logp = jnp.take_along_axis(logp_all, labels[:, None], axis=-1)[:, 0]
  if not with_entropy:
    return logp, None
  return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def _divisor_at_most(total, size):
  """The largest divisor of ``total`` that is ``<= size`` (reshape-able chunks)."""
  size = max(1, min(size, total))
  while total % size:
    size -= 1
  return size


def _scan_remat(per_chunk, chunked, shared, labels, chunk):
  """``per_chunk(*chunk_arrays, *shared, labels_chunk)`` over token chunks, remat body."""
  T = labels.shape[0]
  n = T // chunk
  xs = tuple(a.reshape((n, chunk) + a.shape[1:]) for a in chunked) + (labels.reshape(n, chunk),)

  @jax.checkpoint
  def body(_, args):
    *arrays, lab = args
    logp, entropy = per_chunk(*arrays, *shared, lab)
    return None, (logp, entropy)

  _, (logp, entropy) = lax.scan(body, None, xs)
  return logp.reshape(T), None if entropy is None else entropy.reshape(T)


def _matmul(hidden, weight):
  """The LM head as a model computes it: input-dtype logits."""
  return hidden @ weight


def _import_tokamax():
  """``tokamax`` (0.0.17), importable without ``xprof``, which only tokamax's own
  benchmarking module uses and whose wheels lag (a stub stands in for it)."""
  import importlib.util
  import types
  if "xprof" not in sys.modules and importlib.util.find_spec("xprof") is None:
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
      sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
  import tokamax
  from absl import flags
  if not flags.FLAGS.is_parsed():  # tokamax reads absl flags from sys.argv: not ours
    flags.FLAGS([sys.argv[0]])
  return tokamax


def _tokamax(config: Config, names) -> Built:
  """tokamax's ``linear_softmax_cross_entropy_loss(..., reduction="none")``: per-token
  ``-logp``, the implementation named by the variant (``xla`` materializes the logits,
  ``chunked_xla`` does not); log-prob only, so c = 0."""
  tokamax = _import_tokamax()
  note = (f"tokamax {getattr(tokamax, '__version__', '?')} implementation="
          f"{config.variant!r}, reduction='none'")

  def logp(h, w, lab):
    return -tokamax.linear_softmax_cross_entropy_loss(
        h, lab, w, reduction="none", implementation=config.variant)

  if config.mode == "fwd":
    return Built(logp, names, note=note)
  loss = lambda h, w, lab, adv: jnp.sum(adv * logp(h, w, lab))
  return Built(jax.value_and_grad(loss, argnums=(0, 1)), names, note=note)


def _planned_chunk(config, num_columns, kw, linear=False):
  """The chunk jaxce will use (``jaxce.plan.of`` on one shard's shapes: ``num_columns`` is
  the local vocabulary, the tokens those of one data shard), or ``None`` where the call
  runs none (the Triton forward with the one-pass backward)."""
  import jaxce
  from jaxce import plan
  tokens = config.T // config.data
  dtype, labels = jnp.dtype(config.dtype), jax.ShapeDtypeStruct((tokens,), jnp.int32)
  if linear:
    return plan.of(jaxce.linear_logprobs_and_entropy,
                   jax.ShapeDtypeStruct((tokens, config.D), dtype),
                   jax.ShapeDtypeStruct((config.D, num_columns), dtype), labels, **kw).chunk
  return plan.of(jaxce.logprobs_and_entropy,
                 jax.ShapeDtypeStruct((tokens, num_columns), dtype), labels, **kw).chunk


def _options_note(kw) -> str:
  """The non-default jaxce options of a variant, for the row's ``note``."""
  return ", ".join(f"{k}={v!r}" for k, v in kw.items()
                   if k in ("backward_in_place", "implementation", "hidden_grad_accumulation",
                            "batch_invariant", "batch_axis"))


def _jaxce_fn(linear: bool, sharded: bool):
  """jaxce's per-token function of the input path (fused or logits), in its ``sharded_*``
  form when the vocabulary is split."""
  import jaxce
  if linear:
    return jaxce.sharded_linear_logprobs_and_entropy if sharded else \
        jaxce.linear_logprobs_and_entropy
  return jaxce.sharded_logprobs_and_entropy if sharded else jaxce.logprobs_and_entropy


def _shard_kw(config: Config, mesh: Mesh) -> dict:
  """The ``sharded_*`` keywords of ``mesh`` (none when the vocabulary is whole): the
  vocab axis, and over a data × vocab mesh the data axis as ``batch_axis``."""
  if mesh.shape[VOCAB_AXIS] == 1:
    return {}
  return dict(mesh=mesh, vocab_axis=VOCAB_AXIS,
              **({"batch_axis": DATA_AXIS} if config.data > 1 else {}))


def _per_token_fn(config: Config, mesh: Mesh):
  """``(f, chunk_used, note)``: f maps the float arrays and labels to ``(logp, H)``."""
  entropy = config.entropy
  kw = dict(chunk_size=config.chunk_size, return_entropy=entropy)
  shard_kw = _shard_kw(config, mesh)
  sharded = bool(shard_kw)
  v_local = config.V // mesh.shape[VOCAB_AXIS]
  impl, linear = config.impl, config.input == "linear"

  if config.variant in LOOP_VARIANTS:
    kw["backward_in_place"] = True
  if config.variant in IMPLEMENTATION_VARIANTS:
    kw["implementation"] = config.variant
  if config.variant == "hidden_grad_output":
    kw["hidden_grad_accumulation"] = "output"
  if config.variant == "batch_invariant":
    kw["batch_invariant"] = True
  if config.variant == "token_split":
    if not (sharded and linear):
      raise ValueError("the token_split variant is a sharded fused call")
    shard_kw["batch_axis"] = VOCAB_AXIS
  if config.variant in KEEP_VARIANTS:
    return _kept_sets_fn(config, kw, shard_kw, sharded, v_local)
  if config.variant in TRAIN_STEP_VARIANTS:
    if impl == "jaxce":
      fn = _jaxce_fn(False, sharded)
      f = lambda h, w, lab: fn(_matmul(h, w), lab, **shard_kw, **kw)
      return f, _planned_chunk(config, v_local, kw), _options_note(kw)
    return (lambda h, w, lab: plain_logprobs_entropy(_matmul(h, w), lab, entropy)), None, ""

  if impl == "jaxce":
    fn = _jaxce_fn(linear, sharded)
    if linear:
      f = lambda h, w, lab: fn(h, w, lab, **shard_kw, **kw)
      return f, _planned_chunk(config, v_local, kw, True), _options_note({**kw, **shard_kw})
    f = lambda x, lab: fn(x, lab, **shard_kw, **kw)
    note = _options_note(kw)
    if config.variant in IN_PLACE_VARIANTS:
      note = "; ".join(filter(None, ["logits donated", (
          "jax.grad: gradient only, no loss value" if config.variant == "inplace_grad"
          else "jax.value_and_grad"), note]))
    return f, _planned_chunk(config, v_local, kw), note

  if impl == "jax_plain":
    if linear:
      return (lambda h, w, lab: plain_logprobs_entropy(_matmul(h, w), lab, entropy)), None, ""
    return (lambda x, lab: plain_logprobs_entropy(x, lab, entropy)), None, ""

  if impl == "jax_scan_remat":
    chunk = _divisor_at_most(config.T, config.chunk_size or SCAN_CHUNK)
    if linear:
      per_chunk = lambda h, w, lab: plain_logprobs_entropy(_matmul(h, w), lab, entropy)
      f = lambda h, w, lab: _scan_remat(per_chunk, (h,), (w,), lab, chunk)
    else:
      per_chunk = lambda x, lab: plain_logprobs_entropy(x, lab, entropy)
      f = lambda x, lab: _scan_remat(per_chunk, (x,), (), lab, chunk)
    return f, chunk, ""

  if impl == "optax":
    import optax
    f = lambda x, lab: (-optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), lab), None)
    return f, None, "input upcast to f32 first"

  raise ValueError(f"no per-token JAX function for {config.impl}")


def _kept_sets_fn(config: Config, kw, shard_kw, sharded, v_local):
  """``(f, chunk_used, note)`` of a kept-set variant: f maps the float arrays, the kept
  sets' inputs (``KEEP_INPUTS``) and the labels to jaxce's ``(logp, H)`` with ``keep=``
  (the packed words as they are, or ``jaxce.keep.from_csr`` of the CSR ids)."""
  import jaxce
  linear = config.input == "linear"
  fn = _jaxce_fn(linear, sharded)
  num_floats = 2 if linear else 1

  def f(*args):
    floats, kept, labels = args[:num_floats], args[num_floats:-1], args[-1]
    keep = kept[0] if config.variant == "keep" else jaxce.keep.from_csr(*kept)
    return fn(*floats, labels, keep=keep, **shard_kw, **kw)

  if config.variant == "keep":
    note = f"keep=: packed words keeping {KEPT_FRACTION:.0%} of the columns per token"
    kept = jax.ShapeDtypeStruct((config.T, -(-v_local // 32)), jnp.uint32)
    chunk = _planned_chunk(config, v_local, dict(kw, keep=kept), linear)
  else:
    note = ("keep=jaxce.keep.from_csr(ids, offsets): a sampler's kept ids (prime-rl's set "
            "sizes: median 2, mean ~8), the CSR made into KeptIds inside the timed call")
    chunk = None
  return f, chunk, note


def build(config: Config, devices) -> Built:
  """The function to jit for ``config`` on ``devices`` (the vocab split over them; over a
  ``data × vocab`` mesh of them with ``config.data > 1``)."""
  mesh = _mesh(devices, config.data)
  floats = ("logits",) if config.input == "logits" else ("hidden", "weight")
  names = floats + KEEP_INPUTS.get(config.variant, ()) + (
      ("labels",) if config.mode == "fwd" else ("labels", "adv"))
  donate = (0,) if config.variant in IN_PLACE_VARIANTS else ()

  if config.impl == "tokamax":
    return _tokamax(config, names)
  if config.variant in OBJECTIVE_VARIANTS:
    return _objective_build(config, floats, names, mesh)
  f, chunk_used, note = _per_token_fn(config, mesh)
  if config.mode == "fwd":
    return Built(f, names, donate, chunk_used, note)

  coef, n = config.coef, len(floats)

  def loss(*args):
    *arrays, labels, adv = args
    logp, entropy = f(*arrays, labels)
    total = jnp.sum(adv * logp)
    return total if entropy is None else total + coef * jnp.sum(entropy)

  transform = jax.grad if config.variant == "inplace_grad" else jax.value_and_grad
  return Built(transform(loss, argnums=tuple(range(n))), names, donate, chunk_used, note)


GRPO_SEQUENCE = 1024


def _grpo(adv):
  """The bench's GRPO objective (GRPO_NOTE) and its token args from the advantages: old and
  reference log-probs near the policy's (their values do not change the work), and the
  sequence-mean-token-mean weights of full sequences of GRPO_SEQUENCE tokens."""
  import jaxce
  objective = jaxce.objectives.grpo(0.2, 0.28, beta=0.04, entropy_coef=0.01)
  tokens = adv.shape[0]
  weight = jnp.full_like(adv, 1.0 / (min(GRPO_SEQUENCE, tokens) * max(
      tokens // GRPO_SEQUENCE, 1)))
  return objective, (adv, -2.0 + 0.1 * adv, -2.0 - 0.1 * adv, weight)


def _objective_build(config: Config, floats, names, mesh: Mesh) -> Built:
  """Value and gradients of a per-token objective: the row's loss (``objective``) or the
  GRPO objective, on jaxce's objective path (``objective*``) or, for ``grpo``, on the
  per-token path (jaxce's, or plain JAX's) with autodiff; jaxce's ``sharded_*`` forms
  over ``mesh`` when it has several devices."""
  import jaxce
  linear, coef = config.input == "linear", config.coef
  shard_kw = _shard_kw(config, mesh)
  sharded = bool(shard_kw)

  def objective_and_args(adv):
    if config.variant == "objective":
      return (lambda lp, h, a: a * lp + coef * h), (adv,)
    return _grpo(adv)

  def loss(*args):
    *arrays, labels, adv = args
    objective, token_args = objective_and_args(adv)
    if config.variant != "grpo":
      fn = ((jaxce.sharded_linear_token_loss if linear else jaxce.sharded_token_loss)
            if sharded else (jaxce.linear_token_loss if linear else jaxce.token_loss))
      return fn(objective, *arrays, labels, *token_args, chunk_size=config.chunk_size,
                **shard_kw)[0]
    if config.impl == "jaxce":
      fn = _jaxce_fn(linear, sharded)
      logp, entropy = fn(*arrays, labels, chunk_size=config.chunk_size, **shard_kw)
    else:
      logp, entropy = plain_logprobs_entropy(_matmul(*arrays) if linear else arrays[0], labels)
    return jnp.sum(objective(logp, entropy, *token_args))

  chunk = None
  if config.impl == "jaxce":
    from jaxce import plan
    columns = config.V // mesh.shape[VOCAB_AXIS]
    chunk = (plan.linear_objective_chunk(config.T // config.data, columns, config.chunk_size)
             if linear and config.variant != "grpo" else
             _planned_chunk(config, columns, dict(chunk_size=config.chunk_size), linear))
  note = "" if config.variant == "objective" else GRPO_NOTE
  return Built(jax.value_and_grad(loss, argnums=tuple(range(len(floats)))), names,
               chunk_used=chunk, note=note)


# The token-split layout's per-token inputs: split by tokens over the vocabulary's devices.
TOKEN_SPLIT_SPECS = {"hidden": P(VOCAB_AXIS), "labels": P(VOCAB_AXIS), "adv": P(VOCAB_AXIS)}


# Over a data × vocab mesh: the per-token inputs (and the logits' rows) split over data.
DATA_SPECS = {"logits": P(DATA_AXIS, VOCAB_AXIS), "hidden": P(DATA_AXIS),
              "labels": P(DATA_AXIS), "adv": P(DATA_AXIS)}


def _mesh(devices, data: int = 1) -> Mesh:
  """The vocab axis over ``devices``; with ``data > 1``, a ``data × len(devices) / data``
  mesh (data axis first)."""
  if data == 1:
    return Mesh(np.array(devices), (VOCAB_AXIS,))
  return Mesh(np.array(devices).reshape(data, -1), (DATA_AXIS, VOCAB_AXIS))


def shardings(names, devices, variant="default", data=1) -> dict:
  """``NamedSharding`` of each input over the mesh of ``devices`` (``_mesh``: with ``data >
  1`` the per-token inputs split over its data axis; ``variant`` ``"token_split"``: split
  by tokens over the vocabulary's devices)."""
  mesh = _mesh(devices, data)
  specs = {**SPECS, **(TOKEN_SPLIT_SPECS if variant == "token_split" else {}),
           **(DATA_SPECS if data > 1 else {})}
  return {name: NamedSharding(mesh, specs[name]) for name in names}
