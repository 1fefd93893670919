"""The merge contract: per-token outputs from per-tile softmax statistics, merged in one
fixed order by a kernel (``mosaic_merge`` on the Mosaic GPU backend, ``triton_merge`` on
the Triton one; the stages of each are there; ``logits_rows.merge_tiles`` chooses, and
gathers the vocab shards' tiles first).

The kernels that read or form logits (``mosaic_rows``, ``mosaic_head``, ``triton_rows``)
reduce each tile of columns to per-token statistics ``(m, s, q, picked)``: the tile's max
``m``, ``s = Σ exp(z - m)``, ``q = Σ exp(z - m)(z - m)`` and the label's ``z`` (0 when
the label is not in the tile). A merge kernel takes a token's tiles in the order they
are given (the columns' order: tile 0 first; over vocab shards, gathered in rank order)
and finishes its log-prob and entropy, with the same instructions whatever the call
around it:

    m = max_g m_g                           (pass 1)
    s = Σ_g s_g e_g,  e_g = exp(m_g - m)    (pass 2, g = 0, 1, ... in order)
    q = Σ_g e_g (q_g + (m_g - m) s_g)
    log s = log(s);  entropy = log s - q / s;  logp = (Σ_g picked_g - m) - log s

So a token's outputs depend on its own tiles alone: not on the number of tokens, their
chunking or the program around the call (XLA decides per program how it fuses and
contracts the same maths; a Pallas kernel is one program wherever it is called).

Each backend's ``merge(tiles, *, with_entropy, interpret)`` takes ``tiles [G, 4, C]``
float32 ``(m, s, q, picked)`` (``q`` unused without ``with_entropy``) and returns
``(logp, m, log s, entropy or None)``, ``[C]`` float32 each: the log-prob before ignored
tokens and labels beyond the vocabulary are masked (``softmax.finish_outputs``), and the
backward's residuals. More than ``CONFIG.group`` tiles take stages: each group of up to
``CONFIG.group`` consecutive tiles is merged into its own ``(m, s, q, picked)`` (the same
two passes over its tiles), then the groups are merged in their order.

Over vocab shards the first stage runs where the tiles are
(``partial_sums(tiles, *, segments, with_entropy, interpret)``: the groups within each of a
shard's ``segments``, ``logits_rows.merge_tiles``), so only the groups' sums, ``1 /
CONFIG.group`` of the tiles' bytes, are gathered in rank order and merged. The groups are
fixed by the segments, and the segments by the vocabulary where the shards are whole
segments (``mosaic_tile.segments``): there a token's bits are the same at every such shard
count. Merging one group's sums gives that group's merge, bit for bit (``exp(0) = 1``).
"""

from __future__ import annotations

import jax.numpy as jnp


def padded_tiles(tiles, multiple: int, minimum: int = 0):
  """``tiles [G, 4, C]`` as float32, with zero tokens appended up to a multiple of
  ``multiple`` tokens, at least ``minimum`` (a copy only when tokens are appended)."""
  num_rows = tiles.shape[2]
  padded = num_rows
  if num_rows < minimum or num_rows % multiple:
    padded = max(-(-num_rows // multiple) * multiple, minimum)
  tiles = tiles.astype(jnp.float32)
  if padded != num_rows:
    tiles = jnp.pad(tiles, [(0, 0), (0, 0), (0, padded - num_rows)])
  return tiles
