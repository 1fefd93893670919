"""``1 / temperature`` per token as a Pallas (Triton) kernel on GPUs.

XLA decides per program where ``1 / t`` is computed: a temperature array that a user's
``jit`` closes over is folded on the host at compile time, the same array passed as an
argument is divided on the device, and the two need not give the same bits. Every kernel
that scales logits by ``1 / t`` takes it from here, so a token's scale (and so its
outputs) is the same whichever way the temperature arrives. A Pallas kernel is one
program wherever it is called; XLA never folds it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxce._kernels import chunking, plumbing

plgpu = plumbing.lazy_module("jax.experimental.pallas.triton")

BLOCK = 1024  # tokens per program


def _kernel(t_ref, out_ref):
  out_ref[...] = 1.0 / t_ref[...]


def reciprocal(temperature, *, interpret):
  """``1 / temperature`` of a float32 ``[T]`` array, computed on the device.

  Args:
    temperature: ``[T]`` float32, > 0.
    interpret: run in Pallas' interpreter (off GPUs: tests).

  Returns:
    ``[T]`` float32. Memory: the output (and a padded copy of the input when ``T`` is not
    a multiple of ``BLOCK``).
  """
  (num_tokens,) = temperature.shape
  padded = -(-num_tokens // BLOCK) * BLOCK
  temperature = chunking.pad_rows(temperature.astype(jnp.float32), padded, 1.0)
  block = pl.BlockSpec((BLOCK,), lambda i: (i,))
  out = pl.pallas_call(
      _kernel,
      out_shape=plumbing.shape_dtype_like(temperature, (padded,), jnp.float32),
      grid=(padded // BLOCK,),
      in_specs=[block],
      out_specs=block,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jaxce_reciprocal",
  )(temperature)
  return out[:num_tokens]
