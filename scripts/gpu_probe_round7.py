"""Development probe (GPU), round 7: the fused path's tile shape [chunk, vocab block].

Prediction (bench/NOTES.md, 16): the backward's f32 ``d W`` block accumulator is read and
written once per token chunk, ``8 D V T / chunk`` bytes in all, and the f32 ``d hidden``
accumulator once per vocab block, ``8 D T V / block`` bytes; at a fixed tile size both
sum to the least when chunk ~ block, so [4096, 8192] tiles should beat the then default
[2048, 16384] at the same tile memory. Prints JSON lines: time of fwd+bwd of
``sum(adv * logp) + 0.01 * sum(H)`` and XLA's temp bytes, per shape.

    python scripts/gpu_probe_round7.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp

import jaxce
from _timing import bench, emit

V, D = 151936, 4096
TS = (32768, 8192)
SHAPES = [(2048, 16384), (4096, 8192), (8192, 4096), (4096, 16384), (8192, 8192),
          (3072, 12288), (6144, 6144)]


def main():
  emit(part="device", device=str(jax.devices()[0].device_kind), jax=jax.__version__)
  for T in TS:
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (T, D), jnp.bfloat16)
    w = (0.02 * jax.random.normal(k[1], (D, V), jnp.float32)).astype(jnp.bfloat16)
    labels = jax.random.randint(k[2], (T,), 0, V)
    adv = jax.random.normal(k[3], (T,), jnp.float32)
    for chunk, block in SHAPES:
      if chunk > T:
        continue
      def loss(h, w):
        lp, en = jaxce.linear_logprobs_and_entropy(h, w, labels, chunk_size=chunk,
                                                   vocab_block_size=block)
        return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
      step = jax.jit(jax.value_and_grad(loss, (0, 1)))
      compiled = step.lower(h, w).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes
      emit(part="tile", T=T, chunk=chunk, block=block, ms=bench(step, h, w, repeats=5),
           temp_GiB=temp / 2**30)


if __name__ == "__main__":
  main()
