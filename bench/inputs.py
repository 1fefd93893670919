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

from bench.configs import KEPT_FRACTION, Config

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
  ``hidden @ weight``) are about N(0, 2^2). The ``keep`` variant adds ``keep``, uint32
  ``[T, ceil(V / 32)]`` packed words keeping ``KEPT_FRACTION`` of the columns at random
  (a block of rows); ``kept_ids`` adds a sampler's kept ids in CSR form,
  ``kept_token_ids`` int32 ``[N]`` (each set's first id its label) and ``kept_offsets``
  int32 ``[T + 1]``, whole (``sampler_set_sizes``).
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
  if config.variant == "keep":
    mask = rng.random((min(T, BLOCK_ROWS), V)) < KEPT_FRACTION
    out["keep"] = (pack_words(mask), (T, -(-V // 32)))
  if config.variant == "kept_ids":
    sizes = sampler_set_sizes(rng, T)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    ids = rng.integers(0, V, offsets[-1], dtype=np.int32)
    ids[offsets[:-1]] = labels
    out["kept_token_ids"] = (ids, ids.shape)
    out["kept_offsets"] = (offsets, offsets.shape)
  return out


def pack_words(mask):
  """``bool [R, V]`` -> uint32 ``[R, ceil(V / 32)]``, bit ``v % 32`` of word ``v // 32``
  (``jaxce.keep.pack``'s words, made on the host)."""
  rows, columns = mask.shape
  padded = np.zeros((rows, -(-columns // 32) * 32), bool)
  padded[:, :columns] = mask
  return np.packbits(padded, axis=1, bitorder="little").view("<u4")


def sampler_set_sizes(rng, num_tokens):
  """Kept-set sizes like a top-p 0.97 / top-k 512 sampler's (prime-rl's measurements:
  median 2, mean about 8, p99 about 80): ~46 % singletons, the rest log-normal from 2 up
  to 512."""
  tail = np.clip(np.ceil(np.exp(1.9 + 1.2 * rng.standard_normal(num_tokens))), 2, 512)
  return np.where(rng.random(num_tokens) < 0.46, 1, tail).astype(np.int32)


def host_inputs(config: Config, seed: int = 0) -> dict:
  """The full numpy inputs of :func:`host_blocks` (``np.resize``: one allocation each)."""
  return {k: np.resize(b, shape) for k, (b, shape) in host_blocks(config, seed).items()}


def logits_bytes(config: Config, n_devices: int) -> int:
  """Bytes of the ``[T, V]`` logits (materialized or not), per device."""
  return config.T * (config.V // max(n_devices, 1)) * itemsize(config.dtype)
