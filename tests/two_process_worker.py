"""One of two processes (``jax.distributed`` on localhost, 2 CPU devices each) calling the
sharded wrappers eagerly on global arrays that span both: run by test_sharded.py.

    python tests/two_process_worker.py PROCESS_ID PORT

Exits 0 when this process's shards of the outputs match the reference (a kept label out
of range gives NaN at its position: it cannot be read on one host to raise).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax  # noqa: E402  (after XLA_FLAGS)

try:  # cross-process collectives on CPU (the default in recent JAX)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
except Exception:  # pylint: disable=broad-except
  pass
process_id, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                           process_id=process_id)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxce  # noqa: E402

mesh = jax.make_mesh((2, 2), ("data", "vocab"))
rng = np.random.default_rng(0)
T, D, V, vocab_size = 6, 8, 64, 61
hidden = rng.normal(size=(T, D)).astype(np.float32)
weight = rng.normal(size=(D, V)).astype(np.float32)
labels = rng.integers(0, vocab_size, T).astype(np.int32)
labels[4] = vocab_size + 1  # kept and out of range: NaN, never a finite number
temperature = rng.uniform(0.5, 1.5, T).astype(np.float32)


def global_array(host, spec):
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda i: host[i])


expected = np.asarray(jaxce.reference.logprobs_and_entropy(
    hidden @ weight, labels, vocab_size=vocab_size, temperature=temperature)[0])
kw = dict(mesh=mesh, vocab_axis="vocab", batch_axis="data", vocab_size=vocab_size,
          temperature=global_array(temperature, P("data")))
outputs = {
    "logits": jaxce.sharded_logprobs_and_entropy(
        global_array(hidden @ weight, P("data", "vocab")), global_array(labels, P("data")), **kw),
    "linear": jaxce.sharded_linear_logprobs_and_entropy(
        global_array(hidden, P("data")), global_array(weight, P(None, "vocab")),
        global_array(labels, P("data")), chunk_size=2, vocab_block_size=16, **kw),
}
for name, (logp, _) in outputs.items():
  assert not logp.is_fully_addressable, name
  for shard in logp.addressable_shards:
    got, want = np.asarray(shard.data), expected[shard.index]
    np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"{name} rows {shard.index}")
print(f"process {process_id}: ok")
