"""One dispatcher, one planner: a call gets the same plan (backend, tiles, loop order)
whether it runs on one device, inside the caller's ``shard_map`` with ``vocab_axis``,
through ``sharded_*`` or on arrays split over explicit mesh axes, for the same per-shard
shapes; the default follows the platform the call runs on; an implementation that cannot
run a call is a ``ValueError`` that says why, and ``jaxce.plan.of`` tells which runs."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import devices, jaxce

plan = jaxce.plan
T, D, V_LOCAL, SHARDS = 512, 64, 256, 2  # shapes where every kernel can run
HOPPER = plan.Target("gpu", "9.0", 132)


def _inputs(columns):
  rng = np.random.default_rng(0)
  return dict(
      logits=jnp.asarray(rng.normal(size=(T, columns)), jnp.bfloat16),
      hidden=jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16),
      weight=jnp.asarray(rng.normal(size=(D, columns)), jnp.bfloat16),
      labels=jnp.asarray(rng.integers(0, V_LOCAL, T), jnp.int32),
      adv=jnp.asarray(rng.normal(size=T), jnp.float32))


OBJECTIVE = lambda logp, entropy, adv: -adv * logp + 0.01 * entropy
# operation -> (its local function, its sharded_* function, its operands' names)
OPERATIONS = {
    "logprobs_and_entropy": (jaxce.logprobs_and_entropy, jaxce.sharded_logprobs_and_entropy,
                             ("logits",)),
    "linear_logprobs_and_entropy": (jaxce.linear_logprobs_and_entropy,
                                    jaxce.sharded_linear_logprobs_and_entropy,
                                    ("hidden", "weight")),
    "token_loss": (jaxce.token_loss, jaxce.sharded_token_loss, ("logits",)),
    "linear_token_loss": (jaxce.linear_token_loss, jaxce.sharded_linear_token_loss,
                          ("hidden", "weight")),
}
EXPECTED = {"logprobs_and_entropy": "mosaic", "linear_logprobs_and_entropy": "mosaic",
            "token_loss": "mosaic", "linear_token_loss": "mosaic"}


def _call(operation, fn, operands, labels, adv, **kw):
  if operation.endswith("token_loss"):
    return fn(OBJECTIVE, *operands, labels, adv, **kw)
  return fn(*operands, labels, **kw)


def _plans(operation):
  """The plans of one shard's call made four ways: locally on the shard's shapes, inside
  shard_map with vocab_axis, through sharded_*, and on explicitly split arrays."""
  local_fn, sharded_fn, names = OPERATIONS[operation]
  local, full = _inputs(V_LOCAL), _inputs(V_LOCAL * SHARDS)
  vocab_spec = {"logits": P(None, "v"), "hidden": P(), "weight": P(None, "v")}
  mesh = Mesh(np.array(devices(SHARDS)), ("v",))
  plans = {"local": plan.of(_call, operation, local_fn, [local[n] for n in names],
                            local["labels"], local["adv"])}

  def in_shard_map(*operands):
    out = _call(operation, local_fn, operands, full["labels"], full["adv"], vocab_axis="v")
    return out[0]
  plans["shard_map"] = plan.of(jax.shard_map(
      in_shard_map, mesh=mesh, in_specs=tuple(vocab_spec[n] for n in names), out_specs=P()),
      *[full[n] for n in names])
  plans["sharded"] = plan.of(_call, operation, sharded_fn, [full[n] for n in names],
                             full["labels"], full["adv"], mesh=mesh, vocab_axis="v")
  explicit = jax.make_mesh((SHARDS,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,),
                           devices=devices(SHARDS))
  with jax.set_mesh(explicit):
    split = [jax.device_put(full[n], NamedSharding(explicit, vocab_spec[n])) for n in names]
    plans["explicit"] = plan.of(_call, operation, local_fn, split, full["labels"], full["adv"])
  return plans


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_the_same_plan_on_one_device_and_on_a_mesh(operation, monkeypatch):
  """With the platform a Hopper GPU's (so the Mosaic kernel is supported), every way of
  calling an operation plans the same for the same per-shard shapes: before the one
  dispatcher, sharded_linear_logprobs_and_entropy chose Triton where the local call chose
  Mosaic."""
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: HOPPER)
  plans = _plans(operation)
  assert plans["local"].backend == EXPECTED[operation], plans["local"]
  assert plans["local"].interpret is False and plans["local"].num_cores == 132
  for way, p in plans.items():
    assert p == plans["local"], (way, p, plans["local"])


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_the_same_plan_off_gpus(operation, monkeypatch):
  """On CPUs the default is XLA, the same four ways (the platform a CPU's wherever the
  suite runs: on a GPU host the mesh's devices are GPUs)."""
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: plan.Target("cpu", None, 4))
  plans = _plans(operation)
  assert plans["local"].backend == "xla"
  assert all(p == plans["local"] for p in plans.values()), plans


def test_the_default_follows_the_platform_of_the_call(monkeypatch):
  """With GPUs as the default backend a traced call takes the platform's default: the
  Mosaic kernel where the GPU is a Hopper, XLA on other GPUs (never the deprecated
  Triton backend: only by name), outside shard_map and inside it; float64 stays on XLA;
  a call whose arrays or mesh live on CPU devices (a CPU mesh on a GPU host) uses XLA:
  the kernels cannot run there."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  h = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
  w, labels = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32)
  fused = jaxce.linear_logprobs_and_entropy
  got = plan.of(fused, h, w, labels)
  assert (got.backend, got.interpret) == ("xla", False), got
  assert "not mosaic:" in got.reason, got.reason  # (no Hopper here, or the mixed dtypes)
  assert "triton" not in got.reason, got.reason
  logits = jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)
  hopper = plan.Target("gpu", "9.0", 132)
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: hopper)
  assert plan.of(jaxce.logprobs_and_entropy, logits, labels).backend == "mosaic"
  assert plan.of(jaxce.logprobs_and_entropy, logits.update(dtype=jnp.float64),
                 labels).backend == "xla"
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: hopper._replace(
      capability="8.0"))
  got = plan.of(jaxce.logprobs_and_entropy, logits, labels)
  assert got.backend == "xla" and "needs a Hopper GPU" in got.reason, got
  monkeypatch.undo()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert plan.of(fused, h, jax.ShapeDtypeStruct((8, 16), jnp.float64), labels).backend == "xla"
  mesh = Mesh(np.array(devices(2)), ("vocab",))
  inside = jax.shard_map(lambda h, w, lab: fused(h, w, lab, vocab_axis="vocab")[0], mesh=mesh,
                         in_specs=(P(), P(None, "vocab"), P()), out_specs=P())
  assert plan.of(inside, h, w, labels).backend == "xla"
  concrete = (jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 16), jnp.float32),
              jnp.arange(4, dtype=jnp.int32))
  assert plan.of(fused, *concrete).backend == "xla"  # concrete arrays on CPU devices
  sharded = lambda h, w, lab: jaxce.sharded_linear_logprobs_and_entropy(
      h, w, lab, mesh=mesh, vocab_axis="vocab")
  assert plan.of(sharded, h, w, labels).backend == "xla"  # a CPU mesh
  out = jax.jit(sharded)(*concrete)  # would fail with the kernel
  np.testing.assert_allclose(out[0], np.full(4, -np.log(16.0)), rtol=1e-2)


@pytest.mark.parametrize("operation,implementation,reason", [
    # (100 columns: below a tile, rows the kernel cannot load itself, and TMA's need 32
    # bytes)
    ("logprobs_and_entropy", "mosaic", "the vocabulary .per device. is 100 columns: below "
     "128 a row must be a multiple of 32 bytes"),
    ("token_loss", "mosaic", "the vocabulary .per device. is 100 columns"),
    # (the fused head's kernels refuse the hidden dim; the rows from XLA's matmul are f32)
    ("linear_token_loss", "mosaic", "the hidden dim must be a multiple of 64, got 48; nor "
     "from XLA's matmul: the vocabulary .per device. is 100 columns"),
    ("linear_logprobs_and_entropy", "mosaic", "the hidden dim must be a multiple of 64"),
])
def test_an_implementation_that_cannot_run_says_why(operation, implementation, reason,
                                                    monkeypatch):
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: HOPPER)
  local_fn, _, names = OPERATIONS[operation]
  inputs = _inputs(V_LOCAL)
  operands = [inputs[n][:, :48] if n == "hidden" else inputs[n] for n in names]
  if "weight" in names:
    operands[1] = operands[1][:48, :100] if operation == "linear_token_loss" else operands[1][:48]
  else:
    operands[0] = operands[0][:, :100]
  with pytest.raises(ValueError, match=f'implementation="{implementation}" cannot run this '
                                       f"call: {reason}"):
    plan.of(_call, operation, local_fn, operands, inputs["labels"] % 100, inputs["adv"],
            implementation=implementation)


def test_pallas_is_the_old_name_of_triton():
  inputs = _inputs(V_LOCAL)
  got = plan.of(jaxce.logprobs_and_entropy, inputs["logits"], inputs["labels"],
                implementation="pallas")
  assert (got.backend, got.reason) == ("triton", "asked for")


def test_plan_of_needs_one_call():
  with pytest.raises(ValueError, match="planned 0"):
    plan.of(lambda x: x, jnp.zeros(3))


def test_import_loads_no_pallas_backend():
  """``import jaxce`` leaves JAX's Pallas backends unloaded (each is imported when a
  kernel first needs it: a third of a second saved, and a JAX that lacks one still
  imports jaxce)."""
  code = ("import sys, jaxce; print(sorted(m for m in ('jax.experimental.mosaic.gpu', "
          "'jax._src.pallas.mosaic_gpu.lowering', 'jax._src.pallas.triton.lowering') "
          "if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_a_jax_without_pallas_backends_runs_on_xla(operation, monkeypatch):
  """The day JAX drops a Pallas backend, the default on a Hopper GPU falls back, saying
  why, and asking for it names what is missing."""
  # pylint: disable-next=import-outside-toplevel
  from jaxce._kernels.mosaic import head as mosaic_head, rows as mosaic_rows
  # pylint: disable-next=import-outside-toplevel
  from jaxce._kernels.triton import rows as triton_rows
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: HOPPER)
  monkeypatch.setattr(mosaic_head, "plgpu", None)
  monkeypatch.setattr(mosaic_rows, "plgpu", None)
  monkeypatch.setattr(triton_rows, "plgpu", None)
  local_fn, _, names = OPERATIONS[operation]
  inputs = _inputs(V_LOCAL)
  operands = [inputs[n] for n in names]
  got = plan.of(_call, operation, local_fn, operands, inputs["labels"], inputs["adv"])
  assert got.backend == "xla", got
  assert "not mosaic: this JAX" in got.reason and "no Pallas Mosaic GPU" in got.reason
  with pytest.raises(ValueError, match="has no Pallas Triton backend"):
    plan.of(_call, operation, local_fn, operands, inputs["labels"], inputs["adv"],
            implementation="triton")


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_every_keyword_reaches_the_request(operation, monkeypatch):
  """Each keyword option of a public function (``vocab_axis`` apart, which goes to the
  dispatcher on its own) arrives in the dispatcher's ``Request`` under its own name, from
  the local function and through its ``sharded_*`` twin alike."""
  from jaxce import _dispatch  # pylint: disable=import-outside-toplevel
  local, sharded, names = OPERATIONS[operation]
  received = []
  monkeypatch.setattr(_dispatch, "run", lambda *a, **k: received.append(a[3]))
  keywords = [k for k in local.__kwdefaults__ if k != "vocab_axis"]
  sentinels = {k: object() for k in keywords}
  positional = [OBJECTIVE] if "loss" in operation else []
  positional += [f"<{n}>" for n in names] + ["<labels>"]
  local(*positional, **sentinels)
  sharded(*positional, mesh=None, vocab_axis="v", **sentinels)
  for request in received:
    for name, sentinel in sentinels.items():
      assert getattr(request, name) is sentinel, f"{local.__name__}: {name} is lost"


def test_the_plan_holds_the_reciprocal_the_in_place_backward_and_the_rows(monkeypatch):
  """Decided by the planner, read by the kernels: how ``1 / temperature`` is computed
  (XLA's division off GPUs and for a Python number; on GPUs, for an array, the Hopper
  kernel or XLA's division behind a barrier), the logits path's in-place backward (the
  Mosaic kernel where ``T`` is a multiple of 8, else chunk by chunk) and the rows the
  fused kernels run on (``T`` padded to the Mosaic kernels' multiple of 8, at least 256;
  the objective's at least one group)."""
  # pylint: disable-next=import-outside-toplevel
  from jaxce._kernels.mosaic import reciprocal as mosaic_reciprocal
  inputs = _inputs(V_LOCAL)
  logits, labels = inputs["logits"], inputs["labels"]
  hidden, weight, adv = inputs["hidden"], inputs["weight"], inputs["adv"]
  temperature = jnp.full(T, 0.7)
  of_logits = lambda n=T, **kw: plan.of(jaxce.logprobs_and_entropy, logits[:n], labels[:n],
                                        **kw)
  of_linear = lambda n=T, **kw: plan.of(jaxce.linear_logprobs_and_entropy, hidden[:n],
                                        weight, labels[:n], **kw)
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: plan.Target("cpu", None, 4))
  cpu = of_logits(temperature=temperature, backward_in_place=True)
  assert (cpu.reciprocal, cpu.in_place, of_logits().in_place) == ("xla", "chunks", None)
  assert of_linear(100).rows == 100 and not hasattr(of_logits(), "rows")  # (fused only)
  assert isinstance(of_logits(), plan.LogitsPlan) and isinstance(of_linear(), plan.FusedPlan)
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: HOPPER)
  hopper_kernel = "mosaic" if mosaic_reciprocal.plgpu is not None else "barrier"
  assert of_logits(temperature=temperature).reciprocal == hopper_kernel
  assert of_linear(temperature=temperature).reciprocal == hopper_kernel
  assert of_logits(temperature=0.7).reciprocal == "xla"
  assert of_logits(backward_in_place=True).in_place == "kernel"
  assert of_logits(T - 3, backward_in_place=True).in_place == "chunks"
  keep = jaxce.keep.pack(np.ones((T, logits.shape[-1]), bool))
  assert of_logits(keep=keep).kept_grad_kernel  # (kept sets: the gradient's kernel)
  assert not of_logits(T - 3, keep=keep[:T - 3]).kept_grad_kernel  # (TMA's rows of 8)
  assert not of_logits().kept_grad_kernel
  assert [of_linear(n).rows for n in (T, T - 3, 100)] == [T, T, 256]
  objective = plan.of(jaxce.linear_token_loss, OBJECTIVE, hidden[:100], weight, labels[:100],
                      adv[:100])
  assert objective.rows == max(100, objective.grad_chunk) == 256
  monkeypatch.setattr(plan, "target", lambda *arrays, mesh=None: HOPPER._replace(
      capability="8.0"))
  assert of_logits(temperature=temperature).reciprocal == "barrier"
  assert of_logits(backward_in_place=True).in_place == "chunks"
  assert not of_logits(keep=keep).kept_grad_kernel  # (no Mosaic kernel off Hopper)
