"""The fused path's Mosaic GPU pieces timed one at a time, each over the whole array: the
forward-statistics kernel (at jaxce's L2 walk and at other snake widths and pipeline
depths), the backward's d-logits kernel over all tiles at once, and the two gradient GEMMs
in XLA. Median ms of ``repeats`` calls (bench.timing) and TFLOP/s from the best call.

Two commands print it (there is no command of its own):

    python -m scripts.gpu_check_mosaic_linear --profile 32768   # $OUT/mosaic_profile.json
    python -m bench.machine_floors --out DIR                    # beside the GEMM floors

Off GPUs the kernels run in JAX's GPU interpreter (small shapes only).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp

import jaxce
from bench.timing import time_ms


def problem(tokens, dim, columns, seed=0):
  """bf16 ``hidden [tokens, dim]`` and ``weight [dim, columns]``, labels and per-token
  cotangents ``[2, tokens]``: the fused path's inputs for the GPU check and the profile."""
  keys = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(keys[0], (tokens, dim), jnp.bfloat16)
  weight = (jax.random.normal(keys[1], (dim, columns), jnp.float32) * 0.02).astype(jnp.bfloat16)
  labels = jax.random.randint(keys[2], (tokens,), 0, columns)
  cot = jax.random.normal(keys[3], (2, tokens), jnp.float32)
  return hidden, weight, labels, cot


def profile(tokens, dim, columns, repeats):
  """Where the Mosaic path's fwd+bwd time goes, one whole-array piece at a time: the
  forward kernel, the backward's d-logits kernel over all tiles at once, and the two
  gradient GEMMs (XLA); plus the forward kernel with other L2 walk widths and depths."""
  from jaxce._kernels.mosaic import head as ml  # pylint: disable=import-outside-toplevel
  hidden, weight, labels, cot = problem(tokens, dim, columns)
  ones = jnp.ones((tokens,), jnp.float32)
  device = dict(interpret=jax.default_backend() != "gpu",
                num_cores=jaxce.plan.target().num_cores)
  flops = 2 * tokens * dim * columns
  rows = []

  def add(name, fn, *args):
    ms, best = time_ms(jax.jit(fn), args, repeats, with_min=True)
    rows.append(dict(piece=name, tokens=tokens, ms=ms, tflops=flops / best / 1e9))
    print(json.dumps(rows[-1]), flush=True)

  default = ml.CONFIG
  for width, stages in ((8, 4), (4, 4), (16, 4), (8, 3)):
    ml.CONFIG = dataclasses.replace(default, snake_width=width, stages=stages)
    add(f"forward kernel, snake {width}, {stages} stages", lambda h, w: ml.statistics(
        h, w, labels, ones, None, column_start=0, vocab_dim=1, softcap=None,
        with_entropy=True, **device), hidden, weight)
  ml.CONFIG = default
  grad = lambda h, w: ml.logits_grad(h, w, labels, ones, (ones, ones, ones), (cot[0], cot[1]),
                                     ones > 0, limit=columns, first_kept=0, vocab_dim=1,
                                     softcap=None, **device)
  add("d logits kernel, all tiles", grad, hidden, weight)
  d = jax.block_until_ready(jax.jit(grad)(hidden, weight))
  add("d W = h^T d (XLA)", lambda h, d: jnp.einsum("td,tv->dv", h, d,
                                                  preferred_element_type=jnp.float32), hidden, d)
  add("d h = d W^T (XLA)", lambda d, w: jnp.einsum("tv,dv->td", d, w,
                                                  preferred_element_type=jnp.float32), d, weight)
  return rows
