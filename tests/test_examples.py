"""The GRPO example (examples/): jaxce's step matches a plain-JAX float64 step.

From the same seed, the same rollouts and the same drifted reference policy, ``STEPS`` SGD
steps of the GRPO loss (clipped ratio, KL to the reference, entropy bonus, prompt and
padding masks, temperature 0.7) with log-probs and entropies from jaxce in float32 give the
parameters and metrics of the same steps written with ``jax.nn.log_softmax`` in float64: on
one device, on a data x vocab mesh, under pmap and as two processes.

Tolerances, float32 against the float64 reference (``helpers.TOLERANCE``):
* metrics (loss, KL, entropy, clip fraction: means of per-token log-prob and entropy
  terms): the ``value`` tolerance;
* parameters: per SGD step, ``lr`` times the ``grad`` tolerance, plus the float32 rounding
  of ``theta + update`` (half an ulp of the largest parameter). The float64 jaxce step uses
  the same rule with the float64 table, so it checks the maths to ~1e-10.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TOLERANCE, assert_close, devices
from jax.sharding import PartitionSpec as P

from examples import grpo, multihost
from examples import model as model_lib
from examples.train import Runner, make_mesh, train_on_rollouts

# A tiny problem: V = 1000 (divides over 2, 4 and 8 shards, no power of two), 8 sequences
# of 6 + 6 tokens with random prompt and completion lengths.
FLAGS = ["--vocab", "1000", "--d-model", "32", "--heads", "2", "--layers", "2",
         "--prompts", "4", "--group-size", "2", "--prompt-len", "6", "--completion-len", "6",
         "--inner-steps", "3", "--optimizer", "sgd", "--lr", "0.01", "--temperature", "0.7",
         "--clip-eps", "0.2", "--kl-coef", "0.1", "--entropy-coef", "0.05"]
ARGS = grpo.parse_args(FLAGS)
STEPS, LR = ARGS.inner_steps, ARGS.lr


@pytest.fixture(scope="module")
def problem():
  model_cfg, cfg, optimizer = grpo.configs(ARGS)
  graphdef, params, ref_params, rollouts = grpo.synthetic_problem(ARGS)
  return dict(model_cfg=model_cfg, cfg=cfg, optimizer=optimizer, graphdef=graphdef,
              params=params, ref_params=ref_params, rollouts=rollouts)


def run(problem, dtype=jnp.float32, **kw):
  """``(params, history)`` after STEPS steps; ``kw`` overrides GRPOConfig fields or passes
  ``mesh`` / ``pmap``."""
  layout = {k: kw.pop(k) for k in ("mesh", "pmap") if k in kw}
  graphdef, cast = problem["graphdef"], lambda tree: tree
  if dtype != jnp.float32:
    model_cfg = dataclasses.replace(problem["model_cfg"], dtype=dtype, param_dtype=dtype)
    graphdef = model_lib.abstract_graphdef(model_cfg)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
  return train_on_rollouts(graphdef, cast(problem["params"]), cast(problem["ref_params"]),
                           problem["rollouts"], cfg=dataclasses.replace(problem["cfg"], **kw),
                           optimizer=problem["optimizer"], num_steps=STEPS, **layout)


@pytest.fixture(scope="module")
def reference(problem):
  """The plain-JAX (``jax.nn.log_softmax``) steps in float64."""
  params, history = run(problem, jnp.float64, path="plain")
  # The steps must move: parameters far beyond the tolerance, ratios clipped at some step.
  moved = max(np.max(np.abs(a - b)) for a, b in
              zip(jax.tree.leaves(params), jax.tree.leaves(problem["params"])))
  assert moved > 100 * param_tolerance(problem["params"], jnp.float32)
  assert max(h["clip_fraction"] for h in history) > 0
  assert all(h["kl"] > 0 and h["entropy"] > 0 for h in history)
  return params, history


def param_tolerance(params, dtype):
  biggest = max(np.max(np.abs(x)) for x in jax.tree.leaves(params))
  ulp = np.spacing(np.asarray(biggest, dtype))
  return STEPS * (LR * TOLERANCE[dtype]["grad"] + 0.5 * ulp)


def assert_matches(result, reference, params0, dtype=jnp.float32, what=""):
  (params, history), (ref_params, ref_history) = result, reference
  assert len(history) == len(ref_history) == STEPS
  for step, (h, ref) in enumerate(zip(history, ref_history)):
    assert h.keys() == ref.keys(), what
    for key in h:
      assert_close(h[key], ref[key], TOLERANCE[dtype]["value"], f"{what} step {step} {key}")
  atol = param_tolerance(params0, dtype)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  for (path, p), r in zip(leaves, jax.tree.leaves(ref_params)):
    assert_close(p, r, atol, f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("path", ["objective", "linear", "logits"])
def test_one_device(problem, reference, path):
  assert_matches(run(problem, path=path), reference, problem["params"], what=path)


def test_one_device_float64(problem, reference):
  assert_matches(run(problem, jnp.float64, path="linear"), reference, problem["params"],
                 jnp.float64, "float64")


def test_mesh(problem, reference):
  """jit + shard_map on a 2 x 4 (data x vocab) mesh of simulated CPU devices."""
  mesh = make_mesh(2, 4, devices(8))
  assert_matches(run(problem, mesh=mesh), reference, problem["params"], what="mesh")


@pytest.mark.parametrize("path", ["objective", "linear", "logits", "plain"])
def test_mesh_sequence_parallel(problem, reference, path):
  """The sequence-parallel layout on a 2 x 4 mesh: the batch over all 8 devices, the token
  embedding's rows and the LM head's columns over vocab; jaxce takes the rows as they are
  (its token-split layout), plain JAX gathers them for its logits. The same steps."""
  mesh = make_mesh(2, 4, devices(8))
  cfg = dataclasses.replace(problem["cfg"], sequence_parallel=True)
  runner = Runner(problem["graphdef"], cfg, optax.sgd(LR), mesh=mesh)
  params = runner.place_params(problem["params"])
  assert params["embed"]["embedding"][...].sharding.spec == P("vocab", None)
  assert runner.place_rows(problem["rollouts"][0])[0].sharding.spec == P(("data", "vocab"))
  result = run(problem, mesh=mesh, path=path, sequence_parallel=True)
  assert_matches(result, reference, problem["params"], what=f"sequence parallel {path}")


def _compiled_step(mesh, sequence_parallel, path="objective"):
  """XLA's compiled GRPO step (``path``'s loss, Adam) at ``bench.grpo_step``'s small size
  (D = 1024, 2 layers, 8 x 1024 tokens, V = 151936) on ``mesh``, from abstract arrays placed
  as the layout places them: ``(temporary bytes per device, {collective: bytes})``, the
  bytes of each collective's results summed over the program."""
  import re
  from flax import nnx
  from jax.sharding import NamedSharding
  from examples.loss import Batch, GRPOConfig
  model_cfg = model_lib.ModelConfig(vocab_size=151936, d_model=1024, num_layers=2,
                                    num_heads=8, max_len=1024, dtype=jnp.bfloat16)
  cfg = GRPOConfig(path=path, temperature=0.7, entropy_coef=0.01,
                   sequence_parallel=sequence_parallel)
  runner = Runner(model_lib.abstract_graphdef(model_cfg), cfg, optax.adam(1e-5), mesh=mesh)
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.CausalLM(model_cfg, rngs=nnx.Rngs(0))),
                       nnx.Param)
  place = lambda tree, shardings: jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
  params = place(abstract, runner.param_shardings(abstract))
  adam = jax.eval_shape(runner.optimizer.init, params)
  adam = place(adam, optax.tree_map_params(
      runner.optimizer, lambda _, s: s, adam, jax.tree.map(lambda p: p.sharding, params),
      transform_non_params=lambda _: NamedSharding(mesh, P())))
  split = NamedSharding(mesh, P(runner.row_axes))
  rows = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=split)
  batch = Batch(rows((8, 1024), jnp.int32), rows((8, 1023), jnp.bool_), rows((8,), jnp.float32),
                rows((8, 1023), jnp.float32), rows((8, 1023), jnp.float32))
  compiled = runner.step.lower(params, adam, batch).compile()
  collectives = {}
  for line in compiled.as_text().splitlines():
    op = re.search(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all)(-start)?\(", line)
    if op and " = " in line[:op.start()]:
      result = line[line.index(" = ") + 3:op.start()]
      size = sum(np.prod([int(n) for n in dims.split(",") if n], dtype=np.int64)
                 * {"bf16": 2, "f32": 4, "s32": 4, "pred": 1}[dtype]
                 for dtype, dims in re.findall(r"\b(bf16|f32|s32|pred)\[([0-9,]*)\]", result))
      collectives[op.group(1)] = collectives.get(op.group(1), 0) + int(size)
  return compiled.memory_analysis().temp_size_in_bytes, collectives


def test_sequence_parallel_step_holds_less_per_device():
  """The sequence-parallel layout's compiled step on a 2 x 2 mesh, against the body repeated
  on the vocab axis's devices: fewer temporaries per device (each device runs the model
  body on its own sequences; on CPU under 0.75x, 1.79 against 2.84 GiB; on a GPU the
  head's kernels hold another share of the step), and an all-reduce of the gradients
  smaller by at least 0.9x the token embedding's half (its rows split over vocab: each
  device sums only its own rows' gradient over the data axis)."""
  mesh = make_mesh(2, 2, devices(4))
  temp, collectives = _compiled_step(mesh, False)
  split_temp, split_collectives = _compiled_step(mesh, True)
  embedding_half = 151936 * 1024 * 4 // 2
  assert split_temp < (0.75 if jax.default_backend() == "cpu" else 1) * temp, (split_temp, temp)
  assert split_collectives["all-reduce"] <= collectives["all-reduce"] - 0.9 * embedding_half, (
      split_collectives, collectives)


def test_sequence_parallel_plain_step_gathers_only_the_hidden_states():
  """Plain JAX's step in the sequence-parallel layout moves, besides the gradients'
  all-reduce, only the hidden states' gathers over vocab (32 MiB of results, under 64):
  its logits' gradient is not resharded through the batch split (without the example's
  constraint on the logits XLA's partitioner replicated it: 7.6 GiB of all-gathers and
  2.3 GiB of all-to-alls a step), so the comparison with jaxce's paths is fair."""
  _, collectives = _compiled_step(make_mesh(2, 2, devices(4)), True, path="plain")
  assert collectives.get("all-to-all", 0) == 0, collectives
  assert collectives.get("all-gather", 0) <= 64 * 2**20, collectives


def test_mesh_optimizer_state_sharding(problem):
  """Adam's moments are split like their parameters (the LM head kernel over vocab), not
  gathered on one device."""
  mesh = make_mesh(2, 4, devices(8))
  runner = Runner(problem["graphdef"], problem["cfg"], optax.adam(1e-3), mesh=mesh)
  params = runner.place_params(problem["params"])
  adam = runner.init(params)[0]
  kernel = params["lm_head"]["kernel"][...]
  assert kernel.sharding.spec == P(None, "vocab")
  for moments in (adam.mu, adam.nu):
    for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(moments)):
      assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (m.sharding, p.sharding)


def test_pmap(problem, reference):
  """Data parallel over the 8 local devices, one sequence each, gradients pmean-ed."""
  devices(8)
  assert jax.local_device_count() == 8
  assert_matches(run(problem, pmap=True), reference, problem["params"], what="pmap")


def test_two_processes(problem, reference, tmp_path):
  """Two processes x 2 CPU devices, jax.distributed on localhost, one 2 x 2 mesh whose data
  groups and vocab groups both span the processes (jaxce's collectives cross them)."""
  out = tmp_path / "result.npz"
  multihost.launch([*FLAGS, "--mesh", "2,2"], num_processes=2, local_devices=2,
                   layouts=["crossed"], timeout=150, out=str(out))
  result = np.load(out)
  structure = jax.tree.structure(problem["params"])
  leaves = [result[f"crossed/param/{i}"] for i in range(structure.num_leaves)]
  keys = reference[1][0].keys()
  history = [{k: float(result[f"crossed/{k}"][s]) for k in keys} for s in range(STEPS)]
  assert_matches((jax.tree.unflatten(structure, leaves), history), reference,
                 problem["params"], what="two processes")


def test_one_process_per_device_check(tmp_path, monkeypatch):
  """``scripts/gpu_check_multiprocess.py --tiny``: 2 processes of one CPU device each
  (jax.distributed on localhost, gloo) against one process of 2, the sharded fused head's
  outputs and time on the same global inputs (on a GPU host: one process per GPU, the
  outputs' bits compared on the kernel paths)."""
  from scripts import gpu_check_multiprocess
  monkeypatch.setenv("OUT", str(tmp_path))
  assert gpu_check_multiprocess.main(["--tiny", "--repeats", "2", "--timeout", "150"]) == 0
  report = json.loads((tmp_path / "multiprocess.json").read_text())
  assert report["processes"] == 2 and report["devices"] == 2 and report["ok"], report
  assert report["max_abs_error"] <= 1e-5 and report["processes_ms"] > 0, report


def test_a_coordinator_port_taken_meanwhile_is_tried_again_on_another():
  """``multihost.on_a_free_port``: a run whose coordinator found its port taken (another
  process bound it after ``free_port`` let it go) runs again on a new port; any other
  failure, or the port taken every time, is raised."""
  tried = []

  def taken_once(coordinator):
    tried.append(coordinator)
    if len(tried) == 1:
      raise RuntimeError("process 0 exited\n--- process 0 ---\nbind: Address already in use")
    return "ran"

  assert multihost.on_a_free_port(taken_once) == "ran" and len(tried) == 2
  assert all(c.startswith("localhost:") and int(c.split(":")[1]) > 0 for c in tried)

  def always_taken(coordinator):
    tried.append(coordinator)
    raise RuntimeError("Address already in use")

  tried.clear()
  with pytest.raises(RuntimeError, match="already in use"):
    multihost.on_a_free_port(always_taken, attempts=3)
  assert len(tried) == 3

  def other(coordinator):
    tried.append(coordinator)
    raise RuntimeError("process 1 exited with an error")

  tried.clear()
  with pytest.raises(RuntimeError, match="process 1"):
    multihost.on_a_free_port(other)
  assert len(tried) == 1


def test_entropy_coef_zero(problem, reference):
  """Coefficient 0 with the entropy logged (computed, gradient-free) == the term dropped
  (``return_entropy=False``), within the float32 tolerance (the two programs round in a
  different order); the entropy term itself moves the parameters 100 x more."""
  logged = run(problem, entropy_coef=0.0, log_entropy=True)
  dropped = run(problem, entropy_coef=0.0, log_entropy=False)
  assert "entropy" in logged[1][0] and "entropy" not in dropped[1][0]
  without_entropy = [{k: v for k, v in h.items() if k != "entropy"} for h in logged[1]]
  assert_matches((logged[0], without_entropy), dropped, problem["params"], what="coef 0")
  with_bonus = reference[0]  # entropy_coef=0.05
  diff = max(np.max(np.abs(a - b)) for a, b in
             zip(jax.tree.leaves(logged[0]), jax.tree.leaves(with_bonus)))
  assert diff > 100 * param_tolerance(problem["params"], jnp.float32)


def test_gpu_run_measures_with_every_flag_it_was_given():
  """``examples.gpu_run`` measures each path in a child process: the child's flags carry
  every option of the parent's (the run's own --out, --paths and --timeout aside). Each
  option is given a value other than its default here, so one the child would not get
  fails (``--attention`` did not reach it: rows said cuDNN's attention and ran XLA's)."""
  from examples import gpu_run
  given = ["--vocab", "4000", "--d-model", "32", "--layers", "3", "--heads", "4",
           "--attention", "cudnn", "--sequences", "12", "--seq-len", "20", "--warmup", "3",
           "--steps", "4", "--devices", "6", "--data", "2", "--sequence-parallel"]
  args = gpu_run.parse_args(["--out", "parent.json", *given])
  defaults = vars(gpu_run.parse_args(["--out", "parent.json"]))
  own = {"out", "paths", "timeout", "child"}
  assert {k for k, v in vars(args).items() if v != defaults[k]} == set(defaults) - own
  child = vars(gpu_run.parse_args(gpu_run.child_argv(args, "plain", "child.json")))
  assert child["child"] == "plain" and child["out"] == "child.json"
  assert {k: v for k, v in child.items() if k not in own} == {
      k: v for k, v in vars(args).items() if k not in own}


def test_dispatch_check(tmp_path, monkeypatch):
  """``scripts/gpu_check_dispatch.py`` at tiny shapes: each operation plans and compiles
  the same way locally and through ``sharded_*`` on a one-device mesh, and its report
  (the plans as dicts, the custom calls) is written (on GPUs: the kernels' calls)."""
  from scripts import gpu_check_dispatch
  monkeypatch.setenv("OUT", str(tmp_path))
  gpu_check_dispatch.main(["--tokens", "256", "--dim", "64", "--vocab", "1000", "--repeats", "1"])
  report = json.loads((tmp_path / "dispatch.json").read_text())
  assert report["summary"]["same_kernels_everywhere"], report["summary"]
  assert len(report["rows"]) == 8 and all(r["plan"]["backend"] for r in report["rows"])
