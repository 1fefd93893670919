"""Every input error a user can make raises a clear error that names the argument.

Static errors (shapes, dtypes, options) raise the same way eagerly and under ``jit``.
Value errors need concrete values: an out-of-range label or a temperature <= 0 raises
eagerly; under ``jit`` the label gives a NaN log-prob at its position.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import devices
from strategies import jaxce, vocab_mesh

T, V, D = 5, 8, 3
LOGITS = np.linspace(-2, 2, T * V, dtype=np.float32).reshape(T, V)
LABELS = np.arange(T, dtype=np.int32)
HIDDEN = np.linspace(-1, 1, T * D, dtype=np.float32).reshape(T, D)
WEIGHT = np.linspace(-1, 1, D * V, dtype=np.float32).reshape(D, V)

logits_fn = jaxce.logprobs_and_entropy
linear_fn = jaxce.linear_logprobs_and_entropy

# (id, function, positional args, keyword options, exception, message regex). The
# message must name the argument (and, where there is one, the bad shape or value).
LOGITS_ERRORS = [
    ("logits-int", (LOGITS.astype(np.int32), LABELS), {}, TypeError, r"logits must be a float"),
    ("logits-0d", (np.float32(1), np.int32(0)), {}, ValueError, r"logits must have at least 1"),
    ("labels-float", (LOGITS, LABELS.astype(np.float32)), {}, TypeError,
     r"labels must be an integer array.*float32"),
    ("labels-bool", (LOGITS, LABELS > 2), {}, TypeError, r"labels must be an integer array"),
    ("labels-shape", (LOGITS, LABELS[:3]), {}, ValueError,
     r"labels must have shape logits.shape\[:-1\] = \(5,\), got labels.shape=\(3,\)"),
    ("labels-extra-dim", (LOGITS, LABELS[:, None]), {}, ValueError, r"labels must have shape"),
    ("temperature-shape", (LOGITS, LABELS), dict(temperature=np.ones(3, np.float32)),
     ValueError, r"temperature must be broadcastable to labels.shape=\(5,\).*\(3,\)"),
    ("temperature-bool", (LOGITS, LABELS), dict(temperature=np.ones(T, bool)), TypeError,
     r"temperature must be a float"),
    ("where-int", (LOGITS, LABELS), dict(where=np.ones(T, np.int32)), TypeError,
     r"where must be a bool array"),
    ("where-shape", (LOGITS, LABELS), dict(where=np.ones(3, bool)), ValueError,
     r"where must be broadcastable to labels.shape=\(5,\)"),
    ("chunk-zero", (LOGITS, LABELS), dict(chunk_size=0), ValueError, r"chunk_size.*got chunk_size=0"),
    ("chunk-negative", (LOGITS, LABELS), dict(chunk_size=-3), ValueError, r"chunk_size.*-3"),
    ("chunk-float", (LOGITS, LABELS), dict(chunk_size=2.0), ValueError, r"chunk_size.*2\.0"),
    ("chunk-string", (LOGITS, LABELS), dict(chunk_size="8"), ValueError, r"chunk_size.*'8'"),
    ("chunk-bool", (LOGITS, LABELS), dict(chunk_size=True), ValueError, r"chunk_size.*True"),
    ("vocab-size-too-big", (LOGITS, LABELS), dict(vocab_size=V + 1), ValueError,
     r"vocab_size=9 is larger than the 8 columns of logits"),
    ("vocab-size-zero", (LOGITS, LABELS), dict(vocab_size=0), ValueError, r"vocab_size.*0"),
    ("vocab-size-float", (LOGITS, LABELS), dict(vocab_size=6.0), ValueError, r"vocab_size.*6\.0"),
    ("vocab-axis-unbound", (LOGITS, LABELS), dict(vocab_axis="v"), ValueError,
     r"vocab_axis='v' is not bound"),
    ("implementation", (LOGITS, LABELS), dict(implementation="cuda"), ValueError,
     r"implementation.*'cuda'"),
]

LINEAR_ERRORS = [
    ("hidden-int", (HIDDEN.astype(np.int32), WEIGHT, LABELS), {}, TypeError,
     r"hidden must be a float"),
    ("weight-int", (HIDDEN, WEIGHT.astype(np.int32), LABELS), {}, TypeError,
     r"weight must be a float"),
    ("weight-1d", (HIDDEN, WEIGHT[0], LABELS), {}, ValueError,
     r"weight must have shape \[D, V\].*got weight.shape=\(8,\)"),
    ("weight-3d", (HIDDEN, WEIGHT[None], LABELS), {}, ValueError,
     r"weight must have shape \[D, V\].*\(1, 3, 8\)"),
    ("d-mismatch", (HIDDEN, WEIGHT[:2], LABELS), {}, ValueError,
     r"weight must have shape \[D, V\].*D = hidden.shape\[-1\] = 3, got weight.shape=\(2, 8\)"),
    ("d-mismatch-vd", (HIDDEN, WEIGHT, LABELS), dict(weight_layout="vd"), ValueError,
     r"weight must have shape \[V, D\].*got weight.shape=\(3, 8\)"),
    ("weight-layout", (HIDDEN, WEIGHT, LABELS), dict(weight_layout="VD"), ValueError,
     r"weight_layout.*'VD'"),
    ("hidden-grad-accumulation", (HIDDEN, WEIGHT, LABELS),
     dict(hidden_grad_accumulation="bf16"), ValueError,
     r"hidden_grad_accumulation must be 'float32' or 'output', got .*'bf16'"),
    ("labels-float", (HIDDEN, WEIGHT, LABELS.astype(np.float32)), {}, TypeError,
     r"labels must be an integer array"),
    ("labels-shape", (HIDDEN, WEIGHT, LABELS[:3]), {}, ValueError,
     r"labels must have shape hidden.shape\[:-1\] = \(5,\)"),
    ("bias-shape", (HIDDEN, WEIGHT, LABELS), dict(bias=np.zeros(V - 1, np.float32)),
     ValueError, r"bias must have shape \[V\] = \(8,\), got bias.shape=\(7,\)"),
    ("bias-2d", (HIDDEN, WEIGHT, LABELS), dict(bias=np.zeros((1, V), np.float32)),
     ValueError, r"bias must have shape"),
    ("bias-int", (HIDDEN, WEIGHT, LABELS), dict(bias=np.zeros(V, np.int32)), TypeError,
     r"bias must be a float"),
    ("softcap-zero", (HIDDEN, WEIGHT, LABELS), dict(logit_softcap=0.0), ValueError,
     r"logit_softcap.*0\.0"),
    ("softcap-negative", (HIDDEN, WEIGHT, LABELS), dict(logit_softcap=-30.0), ValueError,
     r"logit_softcap.*-30"),
    ("chunk-zero", (HIDDEN, WEIGHT, LABELS), dict(chunk_size=0), ValueError, r"chunk_size"),
    ("vocab-size-too-big", (HIDDEN, WEIGHT, LABELS), dict(vocab_size=V + 1), ValueError,
     r"vocab_size=9 is larger than the 8 columns of weight"),
    ("vocab-axis-unbound", (HIDDEN, WEIGHT, LABELS), dict(vocab_axis="v"), ValueError,
     r"vocab_axis='v' is not bound"),
    ("temperature-shape", (HIDDEN, WEIGHT, LABELS), dict(temperature=np.ones((2, T), np.float32)),
     ValueError, r"temperature must be broadcastable"),
]

STATIC_ERRORS = ([pytest.param(logits_fn, *c[1:], id="logits-" + c[0]) for c in LOGITS_ERRORS]
                 + [pytest.param(linear_fn, *c[1:], id="linear-" + c[0]) for c in LINEAR_ERRORS])


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("fn,args,kwargs,error,match", STATIC_ERRORS)
def test_static_error_names_the_argument(fn, args, kwargs, error, match, jit):
  call = (lambda *a: fn(*a, **kwargs)) if not jit else jax.jit(lambda *a: fn(*a, **kwargs))
  with pytest.raises(error, match=match):
    call(*(jnp.asarray(a) for a in args))


@pytest.mark.parametrize("fn,args,name", [
    (logits_fn, ("not an array", LABELS), "logits"),
    (logits_fn, (LOGITS, "0 1 2 3 4"), "labels"),
    (logits_fn, (LOGITS, None), "labels"),
    (linear_fn, ("h", WEIGHT, LABELS), "hidden"),
    (linear_fn, (HIDDEN, None, LABELS), "weight"),
    (linear_fn, (HIDDEN, WEIGHT, {"labels": 1}), "labels"),
], ids=["logits-str", "labels-str", "labels-none", "hidden-str", "weight-none", "labels-dict"])
def test_non_array_input_names_the_argument(fn, args, name):
  with pytest.raises(TypeError, match=rf"{name} must be an array, got"):
    fn(*args)


@pytest.mark.parametrize("fn,args,option", [
    (logits_fn, (LOGITS, LABELS), "temperature"), (logits_fn, (LOGITS, LABELS), "where"),
    (linear_fn, (HIDDEN, WEIGHT, LABELS), "bias")], ids=["temperature", "where", "bias"])
def test_non_array_option_names_the_argument(fn, args, option):
  with pytest.raises(TypeError, match=rf"{option} must be an array"):
    fn(*args, **{option: "hot"})


@pytest.mark.parametrize("temperature", [
    0.0, -1.0, np.nan, np.array([1, 1, 0, 1, 1], np.float32),
    np.array([1, 1, 1, -2, 1], np.float32)], ids=["0", "-1", "nan", "one-0", "one-negative"])
@pytest.mark.parametrize("fn,args", [(logits_fn, (LOGITS, LABELS)),
                                     (linear_fn, (HIDDEN, WEIGHT, LABELS))],
                         ids=["logits", "linear"])
def test_bad_temperature_raises_eagerly(fn, args, temperature):
  with pytest.raises(ValueError, match=r"temperature must be > 0"):
    fn(*args, temperature=temperature)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
@pytest.mark.parametrize("path", ["logits", "linear"])
def test_bad_python_temperature_raises_under_jit(path, temperature):
  args = (LOGITS, LABELS) if path == "logits" else (HIDDEN, WEIGHT, LABELS)
  fn = logits_fn if path == "logits" else linear_fn
  with pytest.raises(ValueError, match=r"temperature must be > 0"):
    jax.jit(lambda *a: fn(*a, temperature=temperature))(*args)


@pytest.mark.parametrize("fn,args", [(logits_fn, (LOGITS,)), (linear_fn, (HIDDEN, WEIGHT))],
                         ids=["logits", "linear"])
def test_out_of_range_label_names_its_position(fn, args):
  labels = LABELS.copy()
  labels[3] = V
  with pytest.raises(ValueError, match=re.escape("labels[(3,)] = 8 is out of range for "
                                                 "vocab_size=8")):
    fn(*args, labels)
  # Against a padded vocabulary, in a 2-D batch: the first bad position is named.
  batch = np.stack([LABELS, LABELS])
  batch[1, 2] = 6
  batch[1, 4] = 7
  shaped = tuple(np.stack([a, a]) if i == 0 else a for i, a in enumerate(args))
  with pytest.raises(ValueError, match=re.escape("labels[(1, 2)] = 6 is out of range for "
                                                 "vocab_size=6 (2 such position(s))")):
    fn(*shaped, batch, vocab_size=6)
  # Ignored positions may hold any label.
  fn(*shaped, batch, vocab_size=6, where=batch < 6)
  fn(*shaped, np.where(batch < 6, batch, -100).astype(np.int32), vocab_size=6)


@pytest.mark.parametrize("fn,args", [(logits_fn, (LOGITS,)), (linear_fn, (HIDDEN, WEIGHT))],
                         ids=["logits", "linear"])
def test_out_of_range_label_under_jit_gives_nan_there(fn, args):
  labels = LABELS.copy()
  labels[1], labels[3] = 6, 7  # padded columns: inside the array, outside the vocabulary
  logp, entropy = jax.jit(lambda *a: fn(*a, vocab_size=6))(*args, labels)
  assert np.isnan(logp[1]) and np.isnan(logp[3])
  assert np.isfinite(np.delete(np.asarray(logp), [1, 3])).all() and np.isfinite(entropy).all()


@pytest.mark.parametrize("fn,args,name", [
    (logits_fn, (np.zeros((T, 0), np.float32), np.full(T, -100, np.int32)), "logits"),
    (linear_fn, (HIDDEN, np.zeros((D, 0), np.float32), np.full(T, -100, np.int32)), "weight"),
], ids=["logits", "linear"])
def test_zero_columns_names_the_argument(fn, args, name):
  with pytest.raises(ValueError, match=name):
    fn(*args)


@pytest.mark.parametrize("block", [0, 2.5])
def test_bad_vocab_block_size_names_the_argument(block):
  with pytest.raises(ValueError, match=r"vocab_block_size"):
    linear_fn(HIDDEN, WEIGHT, LABELS, vocab_block_size=block)


# --- the shard_map wrappers -------------------------------------------------------------

def _sharded(path, shards=2, **kw):
  """A jitted-gradient call of a wrapper (a plain eager call has its own bug, see
  test_determinism.py)."""
  fn = (jaxce.sharded_logprobs_and_entropy if path == "logits"
        else jaxce.sharded_linear_logprobs_and_entropy)
  kw.setdefault("mesh", vocab_mesh(shards))
  kw.setdefault("vocab_axis", "v")

  def call(*arrays):
    return jax.grad(lambda a: jnp.sum(fn(a, *arrays[1:], **kw)[0]))(arrays[0])
  return call


def _arrays(path, columns=V):
  logits = np.linspace(-2, 2, T * columns, dtype=np.float32).reshape(T, columns)
  weight = np.linspace(-1, 1, D * columns, dtype=np.float32).reshape(D, columns)
  return (logits, LABELS) if path == "logits" else (HIDDEN, weight, LABELS)


@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("kw,error,match", [
    (dict(vocab_axis="x"), ValueError, r"vocab_axis='x' is not an axis of the mesh"),
    (dict(batch_axis="b"), ValueError, r"batch_axis='b' is not an axis of the mesh"),
    (dict(chunk_size=0), ValueError, r"chunk_size"),
    (dict(vocab_size=V + 1), ValueError, r"vocab_size=9 is larger than the 8 columns"),
    (dict(where=np.ones(T, np.int32)), TypeError, r"where must be a bool array"),
], ids=["vocab-axis", "batch-axis", "chunk", "vocab-size", "where"])
def test_sharded_option_errors_name_the_argument(path, kw, error, match):
  with pytest.raises(error, match=match):
    _sharded(path, **kw)(*_arrays(path))


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_sharded_label_errors_name_the_argument(path):
  arrays = _arrays(path)
  with pytest.raises(TypeError, match=r"labels must be an integer array"):
    _sharded(path)(*arrays[:-1], LABELS.astype(np.float32))
  with pytest.raises(ValueError, match=r"labels must have shape"):
    _sharded(path)(*arrays[:-1], LABELS[:3])


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_sharded_indivisible_vocab_names_the_argument(path):
  name = "logits" if path == "logits" else "weight"
  devices(4)
  with pytest.raises(ValueError, match=rf"{name}.*(divisible|divide)"):
    _sharded(path, shards=4)(*_arrays(path, columns=V - 2))


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_sharded_indivisible_batch_names_the_argument(path):
  """T = 5 tokens over 2 batch shards (JAX's own error names neither array nor option)."""
  mesh = jax.sharding.Mesh(np.array(devices(4)).reshape(2, 2), ("data", "v"))
  name = "logits" if path == "logits" else "hidden"
  with pytest.raises(ValueError, match=rf"{name}.shape\[:-1\] = \(5,\).*2 shards of "
                     r"batch_axis='data'"):
    _sharded(path, mesh=mesh, batch_axis="data")(*_arrays(path))


def test_sharded_out_of_range_label_raises():
  """(Both wrappers share their checks with the plain functions; the logits one stands for
  both.)"""
  labels = LABELS.copy()
  labels[3] = V
  with pytest.raises(ValueError, match=re.escape("labels[(3,)]")):
    _sharded("logits")(LOGITS, labels)


@pytest.mark.parametrize("temperature", [0.0, np.zeros(T, np.float32)], ids=["scalar", "array"])
def test_sharded_bad_temperature_raises(temperature):
  with pytest.raises(ValueError, match=r"temperature must be > 0"):
    _sharded("logits", temperature=temperature)(*_arrays("logits"))


@pytest.mark.parametrize("bad", ["logits", "mesh"])
def test_sharded_non_array_inputs_name_the_argument(bad):
  arrays = ("abc", LABELS) if bad == "logits" else _arrays("logits")
  kw = dict(mesh=None) if bad == "mesh" else {}
  with pytest.raises((TypeError, ValueError), match=bad):
    jaxce.sharded_logprobs_and_entropy(*arrays, vocab_axis="v", **{"mesh": vocab_mesh(2), **kw})
