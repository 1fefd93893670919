"""Host-made (numpy) inputs for one configuration, the same for every implementation.

Large arrays are a small random block tiled to full size (``np.resize``: one allocation,
no per-element random draws), so making a 40 GB ``[131072, 151936]`` bf16 array costs a
memory copy, not minutes of random numbers. The values do not change the work done.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bench.configs import Config

_BLOCK_ROWS = 256
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def itemsize(dtype: str) -> int:
  return np.dtype(DTYPES[dtype]).itemsize


def _tiled_normal(rng, shape, scale, dtype):
  block = (rng.standard_normal((min(shape[0], _BLOCK_ROWS),) + shape[1:], np.float32)
           * scale).astype(DTYPES[dtype])
  return np.resize(block, shape)


def host_inputs(config: Config, seed: int = 0) -> dict:
  """numpy inputs of ``config``.

  Returns:
    ``labels`` int32 ``[T]`` in ``[0, V)``, ``adv`` float32 ``[T]`` (the per-token
    log-prob cotangent), and either ``logits [T, V]`` or ``hidden [T, D]`` and
    ``weight [D, V]`` in ``config.dtype``. Logits are about N(0, 2^2); hidden @ weight too.
  """
  rng = np.random.default_rng(seed)
  T, V = config.T, config.V
  out = dict(labels=rng.integers(0, V, T, dtype=np.int32),
             adv=rng.standard_normal(T, np.float32))
  if config.input == "logits":
    out["logits"] = _tiled_normal(rng, (T, V), 2.0, config.dtype)
  else:
    out["hidden"] = _tiled_normal(rng, (T, config.D), 1.0, config.dtype)
    out["weight"] = _tiled_normal(rng, (config.D, V), 2.0 / np.sqrt(config.D), config.dtype)
  return out


def logits_bytes(config: Config, n_devices: int) -> int:
  """Bytes of the ``[T, V]`` logits (materialized or not), per device."""
  return config.T * (config.V // max(n_devices, 1)) * itemsize(config.dtype)
