"""``1 / temperature`` per token as a Pallas Mosaic GPU kernel (Hopper).

XLA decides per program where ``1 / t`` is computed: a temperature array that a user's
``jit`` closes over is folded on the host at compile time, the same array passed as an
argument is divided on the device, and the two need not give the same bits. Every kernel
that scales logits by ``1 / t`` takes it from here (on GPUs without Mosaic, from XLA's
division behind an optimization barrier, which constant folding does not cross:
``_dispatch._inverse_temperature``), so a token's scale (and so its outputs) is the same
whichever way the temperature arrives. A Pallas kernel is one program wherever it is
called; XLA never folds it.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import chunking, plumbing

plgpu = plumbing.lazy_module("jax.experimental.pallas.mosaic_gpu")



@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The reciprocal kernel's tiling (``CONFIG``).

  Attributes:
    block: tokens per CTA (one warpgroup; a TMA copy takes at most 256 a dimension).
  """
  block: int = 256


CONFIG = Config()


def _kernel(t_gmem, out_gmem):
  block = pl.ds(pl.multiple_of(lax.axis_index("blocks") * CONFIG.block, CONFIG.block), CONFIG.block)

  @partial(pl.run_scoped, smem=plgpu.SMEM((CONFIG.block,), jnp.float32), barrier=plgpu.Barrier())
  def _scope(smem, barrier):
    plgpu.copy_gmem_to_smem(t_gmem.at[block], smem, barrier)
    plgpu.barrier_wait(barrier)
    smem[...] = 1.0 / smem[...]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, out_gmem.at[block])
    plgpu.wait_smem_to_gmem(0)


def reciprocal(temperature, *, interpret):
  """``1 / temperature`` of a float32 ``[T]`` array, computed on the device.

  Args:
    temperature: ``[T]`` float32, > 0.
    interpret: run in JAX's GPU interpreter (off GPUs: tests).

  Returns:
    ``[T]`` float32. Memory: the output (and a padded copy of the input when ``T`` is not
    a multiple of ``CONFIG.block``).
  """
  (num_tokens,) = temperature.shape
  padded = -(-num_tokens // CONFIG.block) * CONFIG.block
  temperature = chunking.pad_rows(temperature.astype(jnp.float32), padded, 1.0)
  out = plgpu.kernel(
      _kernel,
      out_type=plumbing.shape_dtype_like(temperature, (padded,), jnp.float32),
      grid=(padded // CONFIG.block,),
      grid_names=("blocks",),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(temperature)
  return out[:num_tokens]
