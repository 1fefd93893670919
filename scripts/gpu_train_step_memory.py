"""XLA's compiled memory plan of a training step whose logits (``hidden @ W``) are an
intermediate fed to jaxce's logits path, against the floor of one ``[T, V]`` buffer plus
the parameters' gradients (compile only: no arrays allocated).

    python -m scripts.gpu_train_step_memory [--T 32768 --V 151936 --D 4096] [--dump DIR]

``--dump``: XLA's buffer assignment of each step goes to DIR, and the largest temporaries
are printed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--T", type=int, default=32768)
  parser.add_argument("--V", type=int, default=151936)
  parser.add_argument("--D", type=int, default=4096)
  parser.add_argument("--dump")
  parser.add_argument("--variants", default="default,in_place,keep,plain")
  args = parser.parse_args()
  if args.dump:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_dump_to={args.dump} --xla_dump_hlo_as_text")
  import jax
  import jax.numpy as jnp
  import jaxce

  T, V, D = args.T, args.V, args.D
  bf16 = jnp.bfloat16
  shapes = dict(h=jax.ShapeDtypeStruct((T, D), bf16), w=jax.ShapeDtypeStruct((D, V), bf16),
                lab=jax.ShapeDtypeStruct((T,), jnp.int32),
                adv=jax.ShapeDtypeStruct((T,), jnp.float32),
                keep=jax.ShapeDtypeStruct((T, -(-V // 32)), jnp.uint32))
  logits_bytes = T * V * 2
  grads_bytes = (T * D + D * V) * 2

  def step(kind):
    def loss(h, w, lab, adv, keep):
      logits = jnp.dot(h, w)
      if kind == "plain":
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32))
        logp = jnp.take_along_axis(logp_all, lab[:, None], 1)[:, 0]
        ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=1)
      else:
        kw = dict(backward_in_place=kind == "in_place", keep=keep if kind == "keep" else None)
        logp, ent = jaxce.logprobs_and_entropy(logits, lab, **kw)
      return jnp.sum(adv * logp) + 0.01 * jnp.sum(ent)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  rows = []
  for kind in args.variants.split(","):
    compiled = step(kind).trace(*shapes.values()).lower().compile()
    memory = compiled.memory_analysis()
    extra = memory.temp_size_in_bytes + memory.output_size_in_bytes
    row = dict(variant=kind, T=T, V=V, D=D, temp_bytes=memory.temp_size_in_bytes,
               output_bytes=memory.output_size_in_bytes, logits_bytes=logits_bytes,
               extra_x_logits=round(extra / logits_bytes, 3),
               extra_over_floor_x_logits=round((extra - grads_bytes) / logits_bytes, 3),
               device=jax.devices()[0].device_kind, jax=jax.__version__,
               commit=os.environ.get("JAXCE_COMMIT"))
    rows.append(row)
    print(json.dumps(row), flush=True)
  if args.dump:
    for path in sorted(glob.glob(f"{args.dump}/*buffer-assignment.txt")):
      sizes = []
      for line in open(path):
        match = re.match(r"allocation (\d+): size (\d+)", line)
        if match and int(match.group(2)) > logits_bytes // 4:
          sizes.append(line.strip()[:300])
      print(os.path.basename(path), *sizes, sep="\n  ")
  print("variant       extra/logits  (extra - grads)/logits")
  for row in rows:
    print(f"{row['variant']:12s}  {row['extra_x_logits']:12.3f}  "
          f"{row['extra_over_floor_x_logits']:10.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
