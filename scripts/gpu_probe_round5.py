"""Development probe (GPU), round 5: which part of jaxce's training step keeps a second
[T, V] buffer in XLA's GPU memory plan (compile only, T = 8192). Prints JSON lines.

    python scripts/gpu_probe_round5.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp

import jaxce
from _timing import emit
from gpu_probe_round3 import _toy_logp_loop

T, V, D = 8192, 151936, 4096


def main():
  h = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
  labels = jnp.zeros((T,), jnp.int32)
  adv = jnp.ones((T,), jnp.float32)

  def jaxce_loss(**kw):
    def loss(h, w):
      lp, en = jaxce.logprobs_and_entropy(h @ w, labels, **kw)
      return jnp.sum(adv * lp) + (0.0 if en is None else 0.01 * jnp.sum(en))
    return loss

  cases = {
      "pallas_grad": (jaxce_loss(implementation="pallas"), jax.grad),
      "xla_grad": (jaxce_loss(implementation="xla"), jax.grad),
      "pallas_value_and_grad": (jaxce_loss(implementation="pallas"), jax.value_and_grad),
      "xla_value_and_grad": (jaxce_loss(implementation="xla"), jax.value_and_grad),
      "pallas_logp_only_grad": (jaxce_loss(implementation="pallas", return_entropy=False), jax.grad),
      "xla_chunk8192_grad": (jaxce_loss(implementation="xla", chunk_size=8192), jax.grad),
      "xla_fusion_grad": (jaxce_loss(implementation="xla", backward_in_place=False), jax.grad),
      "toy_loop_grad": (lambda h, w: jnp.sum(_toy_logp_loop(h @ w)), jax.grad),
  }
  for name, (loss, transform) in cases.items():
    try:
      c = jax.jit(transform(loss, (0, 1))).lower(h, w).compile()
      emit(part="train_plan", case=name,
           temp_over_logits=c.memory_analysis().temp_size_in_bytes / (T * V * 2))
      if name == "xla_grad":
        open(os.path.join(os.environ.get("OUT", "."), "train_xla_grad_hlo.txt"), "w").write(c.as_text())
    except Exception as ex:  # noqa: BLE001
      emit(part="train_plan", case=name, error=str(ex)[:300])


if __name__ == "__main__":
  main()
