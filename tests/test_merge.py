"""The small kernels around the head, each in its Triton and its Mosaic GPU form
(interpreted off GPUs; the Mosaic ones in JAX's GPU interpreter, JAX >= 0.11):
``*_merge``, per-tile statistics merged in the columns' order into each token's log-prob
and entropy, against float64, one, two and three stages, ragged groups and rows,
masked-out tiles, and without the entropy, a token's bits not depending on the other
tokens in the call; ``mosaic_reciprocal``, ``1 / temperature`` on the device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from helpers import assert_close, jaxce, kernel_device
from jaxce._kernels.mosaic import merge as mosaic_merge, reciprocal as mosaic_reciprocal
from jaxce._kernels.triton import merge as triton_merge


def _mosaic(kernel):
  """``kernel`` (a Mosaic GPU one) as a parameter that skips where it cannot run (a GPU
  other than Hopper; JAX 0.10 off GPUs: Python 3.12 runs it there)."""
  target = jaxce.plan.target()
  if target.platform == "gpu":
    why = None if target.capability == "9.0" else f"a Hopper GPU, got {target.capability}"
  else:
    why = (None if hasattr(plgpu, "InterpretGPUParams")
           else f"JAX's GPU interpreter (JAX >= 0.11), got {jax.__version__}")
  return pytest.param(kernel, id="mosaic",
                      marks=pytest.mark.skipif(why is not None, reason=f"needs {why}"))


def _backends(triton_kernel, mosaic_kernel):
  """``triton_kernel`` and ``mosaic_kernel`` as parameters (the Mosaic one as ``_mosaic``)."""
  return [pytest.param(triton_kernel, id="triton"), _mosaic(mosaic_kernel)]


MERGES = _backends(triton_merge, mosaic_merge)


def _tiles(rng, num_tiles, num_rows):
  """``[G, 4, C]`` statistics as a kernel writes them: shifted maxima, sums of up to 128
  terms relative to them, entropy sums <= 0, the label's logit in one tile per row, and a
  few tiles wholly masked (max ``finfo.min``, sums 0)."""
  m = rng.normal(size=(num_tiles, num_rows)) * 4 - 20
  s = rng.uniform(1, 128, size=(num_tiles, num_rows))
  q = -rng.uniform(0, 1, size=(num_tiles, num_rows)) * s * 3
  picked = np.zeros((num_tiles, num_rows))
  owner = rng.integers(0, num_tiles, num_rows)
  picked[owner, np.arange(num_rows)] = m[owner, np.arange(num_rows)] - rng.uniform(
      0, 5, num_rows)
  masked = rng.random((num_tiles, num_rows)) < 0.05
  masked[owner, np.arange(num_rows)] = False
  m[masked], s[masked], q[masked] = np.finfo(np.float32).min, 0, 0
  return np.stack([m, s, q, picked], axis=1).astype(np.float32)


def _float64(tiles):
  m_g, s_g, q_g, picked = (tiles[:, i].astype(np.float64) for i in range(4))
  m = m_g.max(axis=0)
  scale = np.exp(m_g - m)
  s = (s_g * scale).sum(axis=0)
  q = (scale * (q_g + (m_g - m) * s_g)).sum(axis=0)
  log_s = np.log(s)
  return (picked.sum(axis=0) - m) - log_s, m, log_s, log_s - q / s


@pytest.mark.parametrize("num_tiles,num_rows", [
    (1, 5),      # one tile (the logits path on one device), rows padded to a program's
    (19, 300),   # one stage, ragged rows (not a multiple of 8: a padded copy)
    (70, 264),   # two stages, ragged rows: the last CTA's tokens moved back
    (64, 128),   # exactly one group
    (150, 256),  # two stages, a ragged last group
    (1187, 128),  # V = 151936 in tiles of 128 columns
])
@pytest.mark.parametrize("kernel", MERGES)
def test_merge_matches_float64(kernel, num_tiles, num_rows):
  _check_merge(kernel, num_tiles, num_rows)


@pytest.mark.parametrize("kernel", MERGES)
def test_merge_in_groups_of_8(kernel, monkeypatch):
  """150 tiles in groups of 8: the Mosaic merge in three stages (19 groups, then 3)."""
  monkeypatch.setattr(kernel, "CONFIG", dataclasses.replace(kernel.CONFIG, group=8))
  _check_merge(kernel, 150, 256)


def _check_merge(kernel, num_tiles, num_rows):
  tiles = _tiles(np.random.default_rng(num_tiles), num_tiles, num_rows)
  got = kernel.merge(jnp.asarray(tiles), with_entropy=True,
                     interpret=kernel_device()["interpret"])
  for name, g, w in zip(("logp", "m", "log s", "entropy"), got, _float64(tiles)):
    assert_close(np.asarray(g), w, 2e-6 * max(1.0, float(np.max(np.abs(w)))), name)
  logp, m, log_s, entropy = kernel.merge(jnp.asarray(tiles), with_entropy=False,
                                         interpret=kernel_device()["interpret"])
  assert entropy is None
  np.testing.assert_array_equal(np.asarray(logp), np.asarray(got[0]))


@pytest.mark.parametrize("num_rows", [384, 392])  # (392: the last CTA moved back)
@pytest.mark.parametrize("kernel", MERGES)
def test_a_rows_bits_do_not_depend_on_the_others(kernel, num_rows):
  rng = np.random.default_rng(0)
  tiles = _tiles(rng, 150, num_rows)
  merge = lambda t: np.asarray(kernel.merge(jnp.asarray(t), with_entropy=True,
                                            interpret=kernel_device()["interpret"])[0])
  probes = [0, 200, 300, num_rows - 1]
  alone = np.concatenate([merge(tiles[:, :, i:i + 1]) for i in probes])
  among = merge(tiles)[probes]
  np.testing.assert_array_equal(alone.view(np.uint32), among.view(np.uint32))


def _bits(a):
  return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("kernel", MERGES)
def test_shards_partial_sums_merge_to_one_devices_bits(kernel, monkeypatch):
  """Over vocab shards each shard merges the groups of its segments where its tiles are
  (``partial_sums``) and only those sums are gathered: with the segments fixed by the
  vocabulary, 1, 2 and 4 shards give the same bits (4 segments of 45 tiles in groups of
  16, a ragged last group each: 12 partial sums), close to float64; a lone segment's
  partial sums merge to ``merge``'s own bits; one group's sums merge to its tiles' bits."""
  monkeypatch.setattr(kernel, "CONFIG", dataclasses.replace(kernel.CONFIG, group=16))
  interpret = kernel_device()["interpret"]
  tiles = _tiles(np.random.default_rng(7), 180, 264)
  merged = lambda parts: kernel.merge(jnp.concatenate(parts), with_entropy=True,
                                      interpret=interpret)
  sums = lambda t, segments: kernel.partial_sums(jnp.asarray(t), segments=segments,
                                                 with_entropy=True, interpret=interpret)
  one = merged([sums(tiles, 4)])
  for name, g, w in zip(("logp", "m", "log s", "entropy"), one, _float64(tiles)):
    assert_close(np.asarray(g), w, 2e-6 * max(1.0, float(np.max(np.abs(w)))), name)
  for shards in (2, 4):
    parts = np.split(tiles, shards)
    got = merged([sums(part, 4 // shards) for part in parts])
    for name, g, w in zip(("logp", "m", "log s", "entropy"), got, one):
      np.testing.assert_array_equal(_bits(g), _bits(w), f"{name} at {shards} shards")
  whole = kernel.merge(jnp.asarray(tiles), with_entropy=True, interpret=interpret)
  for g, w in zip(merged([sums(tiles, 1)]), whole):
    np.testing.assert_array_equal(_bits(g), _bits(w))
  few = tiles[:12]
  for g, w in zip(merged([sums(few, 1)]),
                  kernel.merge(jnp.asarray(few), with_entropy=True, interpret=interpret)):
    np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("kernel", [_mosaic(mosaic_reciprocal)])
@pytest.mark.parametrize("num_tokens", [1, 1024, 3000])
def test_reciprocal(kernel, num_tokens):
  temperature = np.random.default_rng(num_tokens).uniform(0.05, 3.0, num_tokens)
  temperature = temperature.astype(np.float32)
  got = np.asarray(kernel.reciprocal(jnp.asarray(temperature),
                                     interpret=kernel_device()["interpret"]))
  assert got.shape == (num_tokens,)
  relative = np.abs(got / (1 / temperature.astype(np.float64)) - 1)
  assert np.max(relative) <= 2.0**-22, f"1 / t: relative error {np.max(relative):.2e}"


def test_reciprocal_off_hopper_is_the_same_for_a_constant_and_an_argument():
  """GPUs without the Mosaic kernel take ``1 / t`` from XLA behind an optimization
  barrier: the same bits whether the caller's ``jit`` closes over the temperature (a
  constant XLA could fold on the host) or passes it (meaningful on a GPU; the barrier's
  path is forced here with another GPU's capability)."""
  from jaxce import _dispatch  # pylint: disable=import-outside-toplevel
  target = jaxce.plan.Target("gpu", "8.0", 132)
  temperature = np.random.default_rng(5).uniform(0.05, 3.0, 4096).astype(np.float32)
  inverse = lambda t: _dispatch._inverse_temperature(t, (4096,), jnp.float32, target)
  passed = np.asarray(jax.jit(inverse)(jnp.asarray(temperature)))
  closed = np.asarray(jax.jit(lambda: inverse(jnp.asarray(temperature)))())
  np.testing.assert_array_equal(passed.view(np.uint32), closed.view(np.uint32))
  relative = np.abs(passed / (1 / temperature.astype(np.float64)) - 1)
  assert np.max(relative) <= 2.0**-23
