"""GPU check of the Pallas statistics inside shard_map (the default there on GPUs).

CI cannot run the kernel inside shard_map (JAX's Pallas interpreter fails the varying-type
check there), so this compares, on every visible GPU as one vocab-split mesh, the sharded
calls with ``implementation="triton"`` against ``implementation="xla"`` and the float64
reference: both paths, a padded vocabulary (the per-shard column limit), a ragged last
vocab block, softcap, per-token temperature, masked rows, values and gradients. Run it on
every GPU kind before a change to the kernels or their defaults lands.

    python -m scripts.gpu_check_sharded_triton      # from the repository root; one JSON line per case

Exits 1 when a case differs by more than its tolerance. (On a CPU it stops at once: there
the kernel is interpreted and cannot run inside shard_map.)
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jaxce
from jaxce import reference

if jax.default_backend() != "gpu":
  sys.exit("needs GPUs: the kernel is interpreted elsewhere and cannot run inside shard_map")
jax.config.update("jax_enable_x64", True)  # the float64 reference only; inputs are f32
devices = jax.devices()
mesh = Mesh(np.array(devices), ("vocab",))
shards = len(devices)
rng = np.random.default_rng(0)
T, D = 300, 64
columns = shards * 4000 + shards * 16  # a ragged last block of 1024-column tiles
vocab_size = columns - 37
hidden = rng.normal(size=(T, D)).astype(np.float32)
weight = (rng.normal(size=(D, columns)) * 0.4).astype(np.float32)
weight[:, rng.integers(0, vocab_size, 5)] *= 8  # peaked columns
bias = (rng.normal(size=columns) - 2.0).astype(np.float32)
labels = rng.integers(0, vocab_size, T).astype(np.int32)
labels[::17] = -100
where = rng.random(T) < 0.9
temperature = rng.uniform(0.6, 1.4, T).astype(np.float32)
cot = rng.normal(size=(2, T))
options = dict(vocab_size=vocab_size, where=where, temperature=temperature)


def run(path, implementation, arrays):
  def loss(*arrays):
    if path == "logits":
      (x,) = arrays
      out = jaxce.sharded_logprobs_and_entropy(x, labels, mesh=mesh, vocab_axis="vocab",
                                               implementation=implementation, **options)
    else:
      h, w, b = arrays
      out = jaxce.sharded_linear_logprobs_and_entropy(
          h, w, labels, bias=b, mesh=mesh, vocab_axis="vocab", logit_softcap=30.0,
          chunk_size=128, vocab_block_size=1024, implementation=implementation, **options)
    return jnp.sum(cot[0] * out[0]) + jnp.sum(cot[1] * out[1]), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, tuple(range(len(arrays))), has_aux=True))(
      *arrays)
  return [np.asarray(a, np.float64) for a in (*out, *grads)]


def run_reference(path, arrays):
  arrays = [jnp.asarray(a, jnp.float64) for a in arrays]

  def loss(*arrays):
    if path == "logits":
      out = reference.logprobs_and_entropy(arrays[0], labels, **options)
    else:
      h, w, b = arrays
      out = reference.linear_logprobs_and_entropy(h, w, labels, bias=b, logit_softcap=30.0,
                                                  **options)
    return jnp.sum(cot[0] * out[0]) + jnp.sum(cot[1] * out[1]), out
  (_, out), grads = jax.value_and_grad(loss, tuple(range(len(arrays))), has_aux=True)(*arrays)
  return [np.asarray(a) for a in (*out, *grads)]


failed = False
logits = np.asarray(jnp.asarray(hidden) @ jnp.asarray(weight) + bias)
for path, arrays in (("logits", (logits,)), ("linear", (hidden, weight, bias))):
  triton, xla, exact = run(path, "triton", arrays), run(path, "xla", arrays), \
      run_reference(path, arrays)
  names = ["logp", "entropy"] + [f"grad{i}" for i in range(len(arrays))]
  for name, p, x, e in zip(names, triton, xla, exact):
    scale = max(1.0, float(np.max(np.abs(e))))
    row = dict(path=path, output=name, shards=shards, pallas_vs_xla=float(np.max(np.abs(p - x))),
               pallas_vs_f64=float(np.max(np.abs(p - e))), xla_vs_f64=float(np.max(np.abs(x - e))),
               nan=bool(np.isnan(p).any()))
    # The kernel may round differently from XLA, never worse than XLA by more than 1e-5
    # of the output's scale.
    row["ok"] = not row["nan"] and row["pallas_vs_f64"] <= row["xla_vs_f64"] + 1e-5 * scale
    failed |= not row["ok"]
    print(json.dumps(row), flush=True)
sys.exit(1 if failed else 0)
