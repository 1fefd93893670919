"""Fingerprints of the StableHLO that jaxce's public calls lower to, for refactors that must
not change what runs.

    python scripts/hlo_fingerprints.py > before.json     # on the old code
    python scripts/hlo_fingerprints.py --compare before.json

Each program is one public call (forward, or forward + gradient with per-token cotangents)
lowered on CPU with 8 simulated devices: plain, inside ``shard_map`` with ``vocab_axis``,
through ``sharded_*`` and on arrays split over explicit mesh axes, with the options that
change the program. A fingerprint is the SHA-256 of the StableHLO text with its function
symbols renamed in order of appearance (``@f0``, ``@f1``...), so renaming a private Python
function does not count as a change; the raw text's hash is kept beside it.

With JAX >= 0.11 the Hopper kernels' calls (``mosaic/...``) are added, and each also gets
the hash of its outputs' bits, run where the script runs (their StableHLO holds a
callback, not the kernels' arithmetic). On a Hopper GPU, ``--only-mosaic`` runs just those,
compiled: run it in the old tree and the new one on the same machine and compare.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxce  # noqa: E402

T, V, D = 24, 160, 16


def _arrays():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, T // 2, V)), jnp.bfloat16)
  hidden = jnp.asarray(rng.normal(size=(2, T // 2, D)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(D, V)) / 4, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, 150, (2, T // 2)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, 2, T // 2)), jnp.float32)
  return logits, hidden, weight, labels, cot


def _weighted(fn, cot):
  def loss(*a):
    logp, ent = fn(*a)
    return jnp.sum(cot[0] * logp) + (0.0 if ent is None else jnp.sum(cot[1] * ent))
  return loss


def programs(only_mosaic=False):
  """``{name: (function, args)}``: the calls whose lowering is fingerprinted (only the
  Hopper kernels' with ``only_mosaic``: one device is enough)."""
  objective = jaxce.objectives.grpo(0.2, 0.28, beta=0.04, entropy_coef=0.01)
  if only_mosaic:
    return _mosaic_programs(objective)
  logits, hidden, weight, labels, cot = _arrays()
  where = labels % 5 != 0
  temp = jnp.linspace(0.7, 1.3, labels.size).reshape(labels.shape)
  mesh2 = Mesh(np.array(jax.devices()[:2]), ("v",))
  mesh4 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("b", "v"))
  out = {}

  logits_options = {
      "default": {}, "no_entropy": dict(return_entropy=False),
      "where_temp_vocab": dict(where=where, temperature=temp, vocab_size=150),
      "chunk5": dict(chunk_size=5), "in_place": dict(backward_in_place=True, chunk_size=7),
      "triton": dict(implementation="triton"),
  }
  for name, kw in logits_options.items():
    f = lambda x, kw=kw: jaxce.logprobs_and_entropy(x, labels, **kw)
    out[f"logits/{name}/fwd"] = (f, (logits,))
    out[f"logits/{name}/grad"] = (jax.grad(_weighted(f, cot)), (logits,))

  linear_options = {
      "default": {}, "no_entropy": dict(return_entropy=False),
      "bias_softcap": dict(bias=jnp.linspace(-1, 1, V).astype(jnp.bfloat16), logit_softcap=5.0),
      "where_temp_vocab": dict(where=where, temperature=temp, vocab_size=150),
      "tiles": dict(chunk_size=7, vocab_block_size=48),
      "token_outer": dict(chunk_size=8, vocab_block_size=32),
      "output_accumulation": dict(hidden_grad_accumulation="output", vocab_block_size=64),
      "triton": dict(implementation="triton", vocab_block_size=64),
  }
  for name, kw in linear_options.items():
    f = lambda h, w, kw=kw: jaxce.linear_logprobs_and_entropy(h, w, labels, **kw)
    out[f"linear/{name}/fwd"] = (f, (hidden, weight))
    out[f"linear/{name}/grad"] = (jax.grad(_weighted(f, cot), (0, 1)), (hidden, weight))
  narrow = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels % 16, chunk_size=5)
  out["linear/token_order/grad"] = (jax.grad(_weighted(narrow, cot), (0, 1)),
                                    (hidden, weight[:, :16]))  # T > V: token chunks outer
  vd = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels, weight_layout="vd")
  out["linear/vd/grad"] = (jax.grad(_weighted(vd, cot), (0, 1)), (hidden, weight.T))

  # Inside the caller's shard_map, through sharded_*, and explicitly split arrays.
  def in_shard_map(fn, specs):
    return jax.shard_map(fn, mesh=mesh2, in_specs=specs, out_specs=P())

  f = lambda x, lab: jnp.sum(jaxce.logprobs_and_entropy(x, lab, vocab_axis="v")[0])
  out["logits/shard_map/grad"] = (jax.grad(in_shard_map(f, (P(None, None, "v"), P()))),
                                  (logits, labels))
  f = lambda h, w, lab: jnp.sum(jaxce.linear_logprobs_and_entropy(h, w, lab, vocab_axis="v")[1])
  out["linear/shard_map/grad"] = (jax.grad(in_shard_map(f, (P(), P(None, "v"), P())), (0, 1)),
                                  (hidden, weight, labels))
  f = lambda x: jaxce.sharded_logprobs_and_entropy(x, labels, mesh=mesh4, vocab_axis="v",
                                                   batch_axis="b")
  out["logits/sharded/grad"] = (jax.grad(_weighted(f, cot)), (logits,))
  f = lambda h, w: jaxce.sharded_linear_logprobs_and_entropy(h, w, labels, mesh=mesh4,
                                                             vocab_axis="v", batch_axis="b")
  out["linear/sharded/grad"] = (jax.grad(_weighted(f, cot), (0, 1)), (hidden, weight))

  token_args = (cot[0], cot[1] - 3, cot[1] - 2, jnp.full(labels.shape, 0.1))
  f = lambda x: jaxce.token_loss(objective, x, labels, *token_args, where=where)[0]
  out["token_loss/default/grad"] = (jax.grad(f), (logits,))
  f = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, *token_args, where=where)[0]
  out["linear_token_loss/default/grad"] = (jax.grad(f, (0, 1)), (hidden, weight))
  f = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, *token_args,
                                           chunk_size=5, logit_softcap=4.0)[0]
  out["linear_token_loss/chunk5_softcap/grad"] = (jax.grad(f, (0, 1)), (hidden, weight))
  f = lambda x: jaxce.sharded_token_loss(objective, x, labels, *token_args, mesh=mesh4,
                                         vocab_axis="v", batch_axis="b")[0]
  out["token_loss/sharded/grad"] = (jax.grad(f), (logits,))
  f = lambda h, w: jaxce.sharded_linear_token_loss(objective, h, w, labels, *token_args,
                                                   mesh=mesh4, vocab_axis="v",
                                                   batch_axis="b")[0]
  out["linear_token_loss/sharded/grad"] = (jax.grad(f, (0, 1)), (hidden, weight))

  if _MOSAIC_INTERPRETER:
    out.update(_mosaic_programs(objective))
    out.update(_cuda_programs(objective))

  explicit = jax.make_mesh((2,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,),
                           devices=jax.devices()[:2])
  with jax.set_mesh(explicit):
    split_w = jax.device_put(weight, NamedSharding(explicit, P(None, "v")))
    f = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels)
    out["linear/explicit/grad"] = (jax.grad(_weighted(f, cot), (0, 1)), (hidden, split_w),
                                   explicit)
  return out


# The Hopper kernels (``implementation="mosaic"``): off GPUs JAX's Mosaic GPU interpreter
# (JAX >= 0.11) runs them from a host callback, so their StableHLO does not hold the
# kernels' arithmetic; their outputs are fingerprinted as well (the bits of every output,
# run where the script runs: the interpreter on CPUs, the kernels on a Hopper GPU).
_MOSAIC_INTERPRETER = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def _mosaic_programs(objective):
  """The Hopper kernels' programs (``implementation="mosaic"``, interpreted) at shapes they
  take: ``T = 36`` (ragged), ``V = 256``, ``D = 64``, bf16."""
  rng = np.random.default_rng(1)
  t, v, d = 36, 256, 64
  logits = jnp.asarray(rng.normal(size=(t, v)) * 3, jnp.bfloat16)
  hidden = jnp.asarray(rng.normal(size=(t, d)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(d, v)) / 8, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, 250, (t,)), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, t)), jnp.float32)
  temp = jnp.linspace(0.7, 1.3, t)
  keep = jaxce.keep.from_logits(logits, top_k=40)
  args = (cot[0], cot[1] - 3, cot[1] - 2, jnp.full((t,), 0.1))  # (GRPO's token arguments)
  out = {}
  options = {"default": {}, "temp_vocab": dict(temperature=temp, vocab_size=250),
             "keep": dict(keep=keep), "softcap": dict(logit_softcap=5.0)}
  for name, kw in options.items():
    kw = dict(kw, implementation="mosaic")
    if name != "softcap":
      f = lambda x, kw=kw: jaxce.logprobs_and_entropy(x, labels, **kw)
      out[f"mosaic/logits/{name}/grad"] = (jax.grad(_weighted(f, cot)), (logits,))
    f = lambda h, w, kw=kw: jaxce.linear_logprobs_and_entropy(h, w, labels, **kw)
    out[f"mosaic/linear/{name}/fwd"] = (f, (hidden, weight))
    out[f"mosaic/linear/{name}/grad"] = (jax.grad(_weighted(f, cot), (0, 1)), (hidden, weight))
    f = lambda h, w, kw=kw: jaxce.linear_token_loss(objective, h, w, labels, *args, **kw)[0]
    out[f"mosaic/linear_token_loss/{name}/grad"] = (jax.grad(f, (0, 1)), (hidden, weight))
  f = lambda x: jaxce.logprobs_and_entropy(x, labels, implementation="mosaic",
                                           backward_in_place=True)
  out["mosaic/logits/in_place/grad"] = (jax.grad(_weighted(f, cot)), (logits,))
  return out


def _cuda_programs(objective):
  """The public calls lowered for CUDA as the planner plans them for a Hopper GPU (JAX >=
  0.11, on any machine): each Mosaic kernel call carries its compiled module's hash, so
  a refactor of the kernels that changes no instruction keeps these fingerprints. Widths
  of whole tiles and of a partial last tile (a multiple of 64, of 16, an odd one), ragged
  ``T``, with the options that change the kernels; shapes only (nothing runs). (The
  reciprocal kernel's module also holds its source lines: a line moved in
  ``mosaic/reciprocal.py`` changes the ``temp`` programs; its outputs' bits, in the
  ``mosaic/`` programs, tell whether it computes the same.)"""
  t, d = 1001, 256
  S = jax.ShapeDtypeStruct
  hidden, labels = S((t, d), jnp.bfloat16), S((t,), jnp.int32)
  cot, row = S((2, t), jnp.float32), S((t,), jnp.float32)
  out = {}

  def fused(h, w, labels, c, temperature, **kw):
    f = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels, **kw, **(
        {"temperature": temperature} if temperature is not None else {}))
    return jax.grad(_weighted(f, c), (0, 1))(h, w)

  def objective_grads(h, w, labels, c, old, ref, weight):
    f = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, c[0], old, ref,
                                             weight)[0]
    return jax.grad(f, (0, 1))(h, w)

  def logits_grads(x, labels, c, keep=None, **kw):
    f = lambda x: jaxce.logprobs_and_entropy(x, labels, keep=keep, **kw)
    return jax.grad(_weighted(f, c))(x)

  for v in (1024, 1088, 1040, 1115):
    weight = S((d, v), jnp.bfloat16)
    for name, kw in {"default": {}, "softcap": dict(logit_softcap=5.0)}.items():
      out[f"cuda/linear/{v}/{name}/grad"] = (
          lambda h, w, l, c, kw=kw: fused(h, w, l, c, None, **kw), (hidden, weight, labels, cot))
    out[f"cuda/linear/{v}/temp/grad"] = (fused, (hidden, weight, labels, cot, row))
    out[f"cuda/linear/{v}/vd/grad"] = (lambda h, w, l, c: fused(h, w, l, c, None,
                                                                 weight_layout="vd"),
                                       (hidden, S((v, d), jnp.bfloat16), labels, cot))
    if v % 16:
      continue
    out[f"cuda/linear_token_loss/{v}/grad"] = (objective_grads,
                                               (hidden, weight, labels, cot, row, row, row))
    logits = S((t, v), jnp.bfloat16)
    out[f"cuda/logits/{v}/default/grad"] = (logits_grads, (logits, labels, cot))
    out[f"cuda/logits/{v}/keep/grad"] = (logits_grads,
                                         (logits, labels, cot, S((t, -(-v // 32)), jnp.uint32)))
    out[f"cuda/logits/{v}/in_place/grad"] = (
        lambda x, l, c: logits_grads(x, l, c, backward_in_place=True),
        (S((1000, v), jnp.bfloat16), S((1000,), jnp.int32), S((2, 1000), jnp.float32)))
  return out


def _lower_for_cuda(fn, arrays):
  """``fn``'s StableHLO lowered for CUDA, planned for a Hopper GPU."""
  target = jaxce.plan.target
  jaxce.plan.target = lambda *a, mesh=None: jaxce.plan.Target("gpu", "9.0", 132)
  try:
    return jax.jit(fn).trace(*arrays).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    jaxce.plan.target = target


def fingerprint(text):
  names = {}
  normal = re.sub(r"@([\w.$-]+)", lambda m: "@" + names.setdefault(m.group(1), f"f{len(names)}"),
                  text)
  return {"normalized": hashlib.sha256(normal.encode()).hexdigest()[:16],
          "raw": hashlib.sha256(text.encode()).hexdigest()[:16]}


def output_bits(fn, arrays):
  """SHA-256 of the bits of every output of ``jax.jit(fn)(*arrays)``, in order."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.jit(fn)(*arrays)):
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()[:16]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--compare", help="a JSON file written by this script")
  parser.add_argument("--dump", help="a folder to write each program's StableHLO to")
  parser.add_argument("--only-mosaic", action="store_true",
                      help="only the Hopper kernels' programs (runs on one GPU)")
  args = parser.parse_args()
  result = {}
  for name, (fn, arrays, *mesh) in programs(args.only_mosaic).items():
    if name.startswith("cuda/"):
      text = _lower_for_cuda(fn, arrays)
    elif mesh:
      with jax.set_mesh(mesh[0]):
        text = jax.jit(fn).lower(*arrays).as_text()
    else:
      text = jax.jit(fn).lower(*arrays).as_text()
    result[name] = fingerprint(text)
    if name.startswith("cuda/"):
      kernels = re.findall(r'kernel_hash = "([^"]*)"', text)
      result[name]["kernels"] = len(kernels)
    if name.startswith("mosaic/"):
      result[name]["outputs"] = output_bits(fn, arrays)
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      with open(os.path.join(args.dump, name.replace("/", "_") + ".mlir"), "w") as f:
        f.write(text)
  if not args.compare:
    json.dump(result, sys.stdout, indent=1)
    print()
    return
  with open(args.compare) as f:
    before = json.load(f)
  key = lambda r: (r["normalized"], r.get("outputs"))
  changed = [n for n in result if n in before and key(result[n]) != key(before[n])]
  for name in sorted(set(result) | set(before)):
    state = ("new" if name not in before else "gone" if name not in result
             else "CHANGED" if name in changed else "same")
    print(f"{state:8s} {name}")
  print(f"{len(result)} programs, {len(changed)} changed")
  sys.exit(1 if changed else 0)


if __name__ == "__main__":
  main()
