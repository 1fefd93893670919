"""Hypothesis strategies and runners for the property-based tests (issue 8).

A :class:`Case` is a small random problem: path (logits or fused linear), sizes drawn from
a few fixed values (so compiled plans are reused across examples: compilation dominates
the run time), dtype, chunking, shard count, temperature, masks, padded vocabulary and a
kind of adversarial logits. :func:`make_inputs` turns it into arrays; :func:`run` computes
outputs and gradients of ``sum(a * logp) + sum(b * entropy)`` (random per-token a, b) with
jaxce, :func:`run_references` with the plain reference (on float64 and on the input dtype),
each in one jitted call whose plan is cached by the static options.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from helpers import TOLERANCE, adversarial_logits, jaxce, reference

# Bounded so the suite stays fast; `JAXCE_HYPOTHESIS_EXAMPLES=200` explores more (and
# randomly: CI runs the same derandomized examples every time).
_EXAMPLES = int(os.environ.get("JAXCE_HYPOTHESIS_EXAMPLES", "0"))


def hypothesis_settings(max_examples):
  """Bounded, deterministic settings (random and larger with JAXCE_HYPOTHESIS_EXAMPLES)."""
  return settings(max_examples=_EXAMPLES or max_examples, deadline=None,
                  derandomize=not _EXAMPLES, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow])


TOKENS = (1, 5, 13, 32)
LOCAL_COLUMNS = (7, 16, 33)  # per shard: V = shards * this
HIDDEN = (4, 16)
CHUNKS = (None, 1, 3, 8, 64)
BLOCKS = (None, 5, 16, 64)
LOGIT_KINDS = ("peaked", "flat", "shift_up", "shift_down", "negative", "banned")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
  """One random problem. Every field is a plain Python value (printable, hashable)."""
  path: str            # "logits" or "linear"
  tokens: int          # T
  columns: int         # V (all shards together)
  hidden: int          # D (linear path)
  dtype: str           # "float32" or "bfloat16"
  shards: int          # vocab shards (1: the plain function; >1: the shard_map wrapper)
  chunk_size: int | None
  block: int | None    # vocab_block_size (linear path)
  vocab_size: int | None
  temperature: str     # "default", "scalar" or "per_token"
  mask: str            # "none", "where", "labels" or "both"
  kind: str            # one of LOGIT_KINDS
  use: str             # outputs in the loss: "both", "logp" or "entropy"
  return_entropy: bool
  bias: bool           # linear path: pass a bias (always, unless "flat" logits)
  implementation: str | None  # None (default), "xla" or "triton" (one device only)
  weight_layout: str   # linear path: "dv" (weight [D, V]) or "vd" (weight [V, D])
  softcap: float | None  # linear path: logit_softcap (never with -inf "banned" logits)
  seed: int

  @property
  def logical_vocab(self):
    return self.vocab_size or self.columns


@st.composite
def cases(draw, path=None, shards=None):
  """Random :class:`Case`; ``path`` / ``shards`` fix those fields when given."""
  path = path or draw(st.sampled_from(("logits", "linear")))
  shards = shards or draw(st.sampled_from((1, 1, 2, 4)))
  columns = shards * draw(st.sampled_from(LOCAL_COLUMNS))
  padded = draw(st.booleans())
  vocab_size = columns - draw(st.integers(1, min(columns - 1, 9))) if padded else None
  use = draw(st.sampled_from(("both", "both", "logp", "entropy")))
  kind = draw(st.sampled_from(LOGIT_KINDS))
  linear = path == "linear"
  # The fused path shifts, bans and peaks its logits through the bias.
  bias = linear and (kind != "flat" or draw(st.booleans()))
  # Pallas (interpreted off GPUs) is not supported inside shard_map.
  implementation = None if shards > 1 else draw(
      st.sampled_from((None, None, "xla", "triton")))
  return Case(
      path=path, tokens=draw(st.sampled_from(TOKENS)), columns=columns,
      hidden=draw(st.sampled_from(HIDDEN)) if linear else 0,
      dtype=draw(st.sampled_from(tuple(DTYPES))), shards=shards,
      chunk_size=draw(st.sampled_from(CHUNKS)),
      block=draw(st.sampled_from(BLOCKS)) if linear else None, vocab_size=vocab_size,
      temperature=draw(st.sampled_from(("default", "scalar", "per_token"))),
      mask=draw(st.sampled_from(("none", "where", "labels", "both"))), kind=kind, use=use,
      return_entropy=use != "logp" or draw(st.booleans()), bias=bias,
      implementation=implementation,
      weight_layout=draw(st.sampled_from(("dv", "vd"))) if linear else "dv",
      softcap=draw(st.sampled_from((None, None, 30.0))) if linear and kind != "banned" else None,
      seed=draw(st.integers(0, 2**31 - 1)))


# Logits of each kind: (scale, offset, peak) for adversarial_logits; "banned" also sets a
# third of the columns to -inf, "flat" is nearly uniform (entropy ~ log V).
_KIND = {"peaked": (4.0, 0.0, 25.0), "flat": (0.01, 0.0, 0.0), "shift_up": (4.0, 300.0, 25.0),
         "shift_down": (4.0, -300.0, 25.0), "negative": (4.0, -80.0, 25.0),
         "banned": (4.0, 0.0, 25.0)}


def make_inputs(case: Case):
  """Arrays of one case, as float64 numpy values already rounded to ``case.dtype``.

  Returns:
    ``(diff, rest, cot)``: ``diff`` the differentiable arrays by keyword (``logits``, or
    ``hidden``, ``weight`` and maybe ``bias``), ``rest`` the other keyword arrays
    (``labels`` int32 ``[T]``, maybe ``temperature`` f32 ``[]`` or ``[T]``, ``where`` bool
    ``[T]``), ``cot`` the per-token cotangents ``(a, b)``, f32 ``[T]`` each.
    Kept labels sit on finite columns below the logical vocabulary.
  """
  rng = np.random.default_rng(case.seed)
  t, v, vocab = case.tokens, case.columns, case.logical_vocab
  scale, offset, peak = _KIND[case.kind]
  if case.path == "logits":
    logits = adversarial_logits(rng, (t, v), scale=scale, offset=offset, peak=peak,
                                banned=0.3 if case.kind == "banned" else 0.0)
    finite = np.isfinite(logits)
    diff = dict(logits=logits)
  else:
    hidden = rng.normal(size=(t, case.hidden))
    weight = rng.normal(size=(case.hidden, v)) * scale / np.sqrt(case.hidden)
    diff = dict(hidden=hidden, weight=weight)
    finite = np.ones((t, v), bool)
    if case.bias:
      bias = np.full(v, offset) + (0.0 if case.kind == "flat" else rng.normal(size=v))
      bias[rng.integers(0, v, max(1, v // 8))] += peak
      if case.kind == "banned":
        bias[rng.random(v) < 0.3] = -np.inf
      finite[:] = np.isfinite(bias)
      diff["bias"] = bias
  labels = np.empty(t, np.int32)
  for i in range(t):
    allowed = np.flatnonzero(finite[i, :vocab])
    if allowed.size == 0:  # keep at least one finite column per row
      allowed = np.array([rng.integers(0, vocab)])
      if case.path == "logits":
        diff["logits"][i, allowed[0]] = rng.normal()
      else:
        diff["bias"][allowed[0]] = rng.normal()
    labels[i] = rng.choice(allowed)
  rest = dict(labels=labels)
  if case.mask in ("labels", "both"):
    labels[rng.random(t) < 0.3] = -100
  if case.mask in ("where", "both"):
    rest["where"] = rng.random(t) >= 0.3
  if case.temperature == "scalar":
    rest["temperature"] = np.float32(rng.uniform(0.5, 2.0))
  elif case.temperature == "per_token":
    rest["temperature"] = rng.uniform(0.5, 2.0, t).astype(np.float32)
  dtype = DTYPES[case.dtype]  # numpy casts to bfloat16 through ml_dtypes
  diff = {k: a.astype(dtype).astype(np.float64) for k, a in diff.items()}
  cot = tuple(rng.normal(size=t).astype(np.float32) for _ in range(2))
  return diff, rest, cot


@functools.lru_cache(maxsize=None)
def vocab_mesh(shards: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:shards]), ("v",))


_FUNCTIONS = {
    ("logits", False): jaxce.logprobs_and_entropy,
    ("linear", False): jaxce.linear_logprobs_and_entropy,
    ("logits", True): jaxce.sharded_logprobs_and_entropy,
    ("linear", True): jaxce.sharded_linear_logprobs_and_entropy,
}


def _outputs_and_grads(fn, diff, rest, cot, use, options):
  """Outputs of ``fn`` and the gradient of ``sum(a * logp) + sum(b * entropy)`` (only the
  outputs named by ``use`` enter the loss: the other one gets a symbolic-zero cotangent)."""
  def loss(diff):
    logp, entropy = fn(**diff, **rest, **options)
    value = jnp.sum(cot[0] * logp) if use in ("both", "logp") else 0.0
    if use in ("both", "entropy"):
      value = value + jnp.sum(cot[1] * entropy)
    return value, (logp, entropy)

  (_, outputs), grads = jax.value_and_grad(loss, has_aux=True)(diff)
  return outputs, grads


def jaxce_eager(diff, rest, cot, *, path, shards=1, use="both", options=()):
  """jaxce's ``((logp, entropy), grads)``, not jitted.

  Args:
    diff: differentiable arrays by keyword: ``logits``, or ``hidden``, ``weight`` and
      optionally ``bias``.
    rest: other keyword arrays (``labels``, ``temperature``, ``where``).
    cot: per-token cotangents ``(a, b)`` of the loss ``sum(a * logp) + sum(b * entropy)``.
    path: ``"logits"`` or ``"linear"``.
    shards: > 1 runs the shard_map wrapper over that many simulated devices (axis "v").
    use: the outputs in the loss, ``"both"``, ``"logp"`` or ``"entropy"``.
    options: other keyword options, a hashable tuple of ``(name, value)`` pairs.
  """
  options = dict(options)
  if shards > 1:
    options.update(mesh=vocab_mesh(shards), vocab_axis="v")
  return _outputs_and_grads(_FUNCTIONS[path, shards > 1], diff, rest, cot, use, options)


jaxce_jit = jax.jit(jaxce_eager, static_argnames=("path", "shards", "use", "options"))


@functools.partial(jax.jit, static_argnames=("path", "use", "options"))
def _references(diff_exact, diff_plain, rest, cot, *, path, use, options):
  """The reference on float64 inputs and on the inputs' own dtype, in one compiled call."""
  fn = reference.logprobs_and_entropy if path == "logits" else reference.linear_logprobs_and_entropy
  options = dict(options)
  return tuple(_outputs_and_grads(fn, diff, rest, cot, use, options)
               for diff in (diff_exact, diff_plain))


def options_of(case: Case, **overrides):
  """Keyword options of the public call (hashable: a sorted tuple of pairs)."""
  options = dict(vocab_size=case.vocab_size, chunk_size=case.chunk_size,
                 return_entropy=case.return_entropy)
  if case.path == "linear":
    options.update(vocab_block_size=case.block, weight_layout=case.weight_layout,
                   logit_softcap=case.softcap)
  if case.implementation is not None:
    options["implementation"] = case.implementation
  options.update(overrides)
  return tuple(sorted(options.items()))


def simple_inputs(path, shape, *, columns, hidden=8, seed=0, dtype=np.float32):
  """``(diff, rest, cot)`` of one path (see :func:`jaxce_eager`), numpy in ``dtype``:
  peaked logits (or ``hidden [*shape, D]``, ``weight [D, V]``, ``bias [V]`` with O(4)
  logits), labels ``[*shape]`` and per-token cotangents ``[*shape]``."""
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, columns, shape).astype(np.int32)
  if path == "logits":
    diff = dict(logits=adversarial_logits(rng, shape + (columns,)))
  else:
    diff = dict(hidden=rng.normal(size=shape + (hidden,)),
                weight=rng.normal(size=(hidden, columns)) * 4 / np.sqrt(hidden),
                bias=rng.normal(size=columns))
  diff = {k: a.astype(dtype) for k, a in diff.items()}
  cot = tuple(rng.normal(size=shape).astype(np.float32) for _ in range(2))
  return diff, dict(labels=labels), cot


def run_jaxce(path, inputs, *, shards=1, jit=True, use="both", **options):
  """jaxce's ``((logp, entropy), grads)`` as numpy for :func:`simple_inputs`-like
  ``inputs``, jitted (:data:`jaxce_jit`) or eagerly, options as keywords."""
  diff, rest, cot = jax.tree.map(jnp.asarray, inputs)
  fn = jaxce_jit if jit else jaxce_eager
  out = fn(diff, rest, cot, path=path, shards=shards, use=use,
           options=tuple(sorted(options.items())))
  return jax.tree.map(np.asarray, out)


def _arrays(case, inputs, dtype):
  diff, rest, cot = inputs
  return ({k: jnp.asarray(a, dtype) for k, a in diff.items()},
          {k: jnp.asarray(a) for k, a in rest.items()}, tuple(jnp.asarray(c) for c in cot))


def run(case: Case, inputs, **overrides):
  """jaxce's ``((logp, entropy), grads)`` for one case, as numpy arrays.

  Args:
    case, inputs: a :class:`Case` and its :func:`make_inputs`.
    **overrides: options replacing the case's (``chunk_size=``, ``vocab_block_size=``,
      ``shards=``). With ``shards > 1`` the shard_map wrapper runs over that many
      simulated devices.

  Returns:
    Outputs (float32) and the gradient dict (``case.dtype``), numpy; ``weight`` and its
    gradient are ``[D, V]`` whatever the layout passed to jaxce.
  """
  shards = overrides.pop("shards", case.shards)
  diff, rest, cot = _arrays(case, inputs, DTYPES[case.dtype])
  transpose = case.path == "linear" and case.weight_layout == "vd"
  if transpose:
    diff["weight"] = diff["weight"].T
  (outputs, grads) = jaxce_jit(diff, rest, cot, path=case.path, shards=shards, use=case.use,
                               options=options_of(case, **overrides))
  if transpose:
    grads["weight"] = grads["weight"].T
  return jax.tree.map(np.asarray, (outputs, grads))


def run_references(case: Case, inputs):
  """``(exact, plain)``: the plain-JAX reference's outputs and grads on float64 upcasts
  of the inputs, and on the inputs in ``case.dtype`` (computing in float32)."""
  exact_diff, rest, cot = _arrays(case, inputs, jnp.float64)
  plain_diff = {k: a.astype(DTYPES[case.dtype]) for k, a in exact_diff.items()}
  options = (("return_entropy", case.return_entropy), ("vocab_size", case.vocab_size))
  if case.softcap is not None:
    options += (("logit_softcap", case.softcap),)
  out = _references(exact_diff, plain_diff, rest, cot, path=case.path, use=case.use,
                    options=options)
  return jax.tree.map(np.asarray, out)


def logit_scale(case: Case, inputs) -> float:
  """Largest finite ``|logits / temperature|`` of the case (float64)."""
  _, rest, _ = inputs
  logits = _logits64(case, inputs)
  t = np.broadcast_to(rest.get("temperature", 1.0), (case.tokens,))
  z = np.abs(logits / t[:, None])
  return float(np.max(z[np.isfinite(z)], initial=0.0))


def _logits64(case: Case, inputs):
  """``[T, V]`` float64 logits of the case (the fused path's
  ``softcap(hidden @ weight + bias)``)."""
  diff = inputs[0]
  if case.path == "logits":
    return diff["logits"]
  logits = diff["hidden"] @ diff["weight"] + diff.get("bias", 0.0)
  if case.softcap is not None:
    logits = case.softcap * np.tanh(logits / case.softcap)
  return logits


def max_error(actual, expected):
  """Max abs difference as float64 (0 for empty arrays); NaN when either has a NaN."""
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
  if not actual.size:
    return 0.0
  if np.isnan(actual).any() or np.isnan(expected).any():
    return np.nan
  return float(np.max(np.abs(actual - expected)))


def assert_as_accurate_as_plain_jax(case: Case, result, inputs):
  """jaxce's error against the float64 reference (on float64 upcasts of the very same
  rounded inputs) is at most the plain-JAX path's own error (the reference run on the
  inputs in ``case.dtype``, computing in float32) plus the float32 tolerance.

  For float32 inputs with O(10) logits the plain error is ~1e-6, so this is the float32
  tolerance table; for bf16, and for logits shifted by +-300 where f32 rounding of
  ``x / T`` is itself ~3e-5, it is "no worse than plain JAX at the same input precision".

  One exception, a margin of one bf16 epsilon (2^-7) of the largest gradient: the fused
  path's bf16 gradients. Its backward rounds each ``d logits`` tile to bf16 before the
  two matmuls (bf16 operands, f32 accumulation), where plain JAX keeps the logits'
  cotangent in f32; that measured up to ~4x plain JAX's error, 0.6 bf16 epsilon.
  """
  exact, plain = run_references(case, inputs)
  tol = TOLERANCE[jnp.float32]
  names = ["logp", "entropy"] + [f"d {k}" for k in sorted(result[1])]
  flat = lambda r: [r[0][0], r[0][1]] + [r[1][k] for k in sorted(r[1])]
  for name, got, want, base in zip(names, flat(result), flat(exact), flat(plain)):
    if got is None:
      assert want is None, name
      continue
    is_grad = name.startswith("d ")
    assert got.dtype == (base.dtype if is_grad else np.float32), f"{name}: dtype {got.dtype}"
    err, plain_err = max_error(got, want), max_error(base, want)
    assert not np.isnan(plain_err), f"{name}: the reference itself has NaN"
    atol = plain_err + tol["grad" if is_grad else "value"]
    if is_grad and case.path == "linear" and case.dtype == "bfloat16" and want.size:
      atol += 2.0**-7 * np.max(np.abs(want))
    assert err <= atol, (f"{name}: max abs error {err:.3e} vs float64 > plain-JAX "
                         f"{case.dtype} error {plain_err:.3e} + margin {atol - plain_err:.1e}")
