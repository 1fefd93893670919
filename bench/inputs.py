"""Host-made (numpy) inputs for one configuration, the same for every implementation.

Large arrays are a small random block of rows tiled to full size, so a 40 GB
``[131072, 151936]`` bf16 array costs a copy, not minutes of random draws; the values do
not change the work done. The JAX runner puts only the blocks on the device and tiles them
there (the blocks stay alive, so they count among the inputs, never in the extra memory);
the PyTorch runner tiles on the host (``np.resize``, the same values).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bench.configs import Config

BLOCK_ROWS = 256
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def itemsize(dtype: str) -> int:
  return np.dtype(DTYPES[dtype]).itemsize


def _block(rng, shape, scale, dtype):
  rows = (min(shape[0], BLOCK_ROWS),) + shape[1:]
  return (rng.standard_normal(rows, np.float32) * scale).astype(DTYPES[dtype]), shape


def host_blocks(config: Config, seed: int = 0) -> dict:
  """``{name: (block, full_shape)}``: each input is ``block`` tiled along its rows.

  Inputs: ``labels`` int32 ``[T]`` in ``[0, V)`` and ``adv`` float32 ``[T]`` (the
  per-token log-prob cotangent), whole; ``logits [T, V]`` or ``hidden [T, D]`` and
  ``weight [D, V]`` in ``config.dtype`` as blocks of at most 256 rows. Logits (given or
  ``hidden @ weight``) are about N(0, 2^2).
  """
  rng = np.random.default_rng(seed)
  T, V = config.T, config.V
  labels = rng.integers(0, V, T, dtype=np.int32)
  adv = rng.standard_normal(T, np.float32)
  out = dict(labels=(labels, labels.shape), adv=(adv, adv.shape))
  if config.input == "logits":
    out["logits"] = _block(rng, (T, V), 2.0, config.dtype)
  else:
    out["hidden"] = _block(rng, (T, config.D), 1.0, config.dtype)
    out["weight"] = _block(rng, (config.D, V), 2.0 / np.sqrt(config.D), config.dtype)
  return out


def host_inputs(config: Config, seed: int = 0) -> dict:
  """The full numpy inputs of :func:`host_blocks` (``np.resize``: one allocation each)."""
  return {k: np.resize(b, shape) for k, (b, shape) in host_blocks(config, seed).items()}


def logits_bytes(config: Config, n_devices: int) -> int:
  """Bytes of the ``[T, V]`` logits (materialized or not), per device."""
  return config.T * (config.V // max(n_devices, 1)) * itemsize(config.dtype)
