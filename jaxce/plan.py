"""How a call is run: the tile plan of both paths and the forward's implementation.

Public, so that benchmarks, notebooks and users can see the plan a call will use:

    chunk = jaxce.plan.logits_chunk(num_tokens, num_columns)          # logits path
    chunk, block = jaxce.plan.linear_tiles(num_tokens, num_columns)   # fused path
    jaxce.plan.linear_backward_order(num_tokens, num_columns)       # "vocab" or "token"
    chunk = jaxce.plan.linear_objective_chunk(num_tokens, num_columns) # linear_token_loss
    jaxce.plan.implementation(None, logits)                  # "pallas", "xla" or "mosaic"

``num_columns`` is the vocabulary a device holds (``V_local`` when it is split). Every
budget is per backend; bench/NOTES.md has the measurements behind each number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Logits path: bytes of one f32 [chunk, V_local] tile of the XLA forward (fused into the
# row reductions on GPUs, so the real working set is about 1% of it; materialized on
# CPUs, hence their small budget). bench/NOTES.md, entries 14 and 17.
LOGITS_TILE_BYTES = {"gpu": 4 * 2**30, "cpu": 16 * 2**20}
# Fused path: bytes of one f32 [chunk, block] tile (a matmul output, materialized), and
# the vocab block. bench/NOTES.md, entries 16 and 17.
LINEAR_TILE_BYTES = {"gpu": 256 * 2**20, "cpu": 32 * 2**20}
DEFAULT_VOCAB_BLOCK = 8192
# Fused objective path (linear_token_loss): bytes of one chunk's f32 [chunk, V_local]
# rows, held from its statistics to its gradient (plus the operand-dtype d logits). Each
# chunk also reads and writes the f32 [D, V_local] d W sum, so larger chunks run faster
# at more memory (bench/NOTES.md, entry 20).
LINEAR_OBJECTIVE_ROWS_BYTES = {"gpu": 2**30, "cpu": 16 * 2**20}
# Fused path, Mosaic GPU forward: bytes of one chunk's f32 [V_local / 128, 4, chunk] tile
# statistics (1/32 of its f32 [chunk, V_local] logits).
LINEAR_KERNEL_STATS_BYTES = 256 * 2**20
IMPLEMENTATIONS = ("xla", "pallas", "mosaic")


def backend() -> str:
  """The budgets' key: ``"cpu"``, or ``"gpu"`` for every other backend."""
  return "cpu" if jax.default_backend() == "cpu" else "gpu"


def chunk_size(num_tokens: int, num_columns: int, requested: int | None,
               tile_bytes: int) -> int:
  """Tokens per step: ``min(requested, T)``, or the largest chunk whose f32
  ``[chunk, num_columns]`` tile fits ``tile_bytes``, moved down to a divisor of T if one
  lies within a factor 2 (so no ragged last chunk), and T itself when all of it fits."""
  if requested is not None:
    return min(requested, num_tokens)
  cap = max(1, min(num_tokens, tile_bytes // (4 * max(num_columns, 1))))
  if cap == num_tokens:
    return cap  # one chunk: rounding it down would only add a step
  if cap >= 8:
    cap -= cap % 8
  for size in range(cap, max(cap // 2, 1) - 1, -1):
    if num_tokens % size == 0:
      return size
  return cap


def logits_chunk(num_tokens: int, num_columns: int, requested: int | None = None) -> int:
  """Tokens per step of the logits path's XLA forward and in-place backward
  (``LOGITS_TILE_BYTES`` of this backend)."""
  return chunk_size(num_tokens, num_columns, requested, LOGITS_TILE_BYTES[backend()])


def linear_tiles(num_tokens: int, num_columns: int, requested_chunk: int | None = None,
                 requested_block: int | None = None) -> tuple[int, int]:
  """``(chunk, block)`` of the fused path: ``block = min(requested_block or
  DEFAULT_VOCAB_BLOCK, num_columns)``, the chunk planned for a ``[chunk, block]`` tile
  of ``LINEAR_TILE_BYTES`` of this backend."""
  block = min(requested_block or DEFAULT_VOCAB_BLOCK, num_columns)
  return chunk_size(num_tokens, block, requested_chunk, LINEAR_TILE_BYTES[backend()]), block


def linear_objective_chunk(num_tokens: int, num_columns: int,
                           requested: int | None = None) -> int:
  """Tokens per step of the fused objective path, whose full ``[chunk, num_columns]``
  rows are held at once (``LINEAR_OBJECTIVE_ROWS_BYTES`` of this backend)."""
  return chunk_size(num_tokens, num_columns, requested,
                    LINEAR_OBJECTIVE_ROWS_BYTES[backend()])


def linear_kernel_chunk(num_tokens: int, num_columns: int) -> int:
  """Tokens per call of the fused path's Mosaic GPU forward kernel (``implementation=
  "mosaic"``): its tile statistics take 1/32 of the bytes of the chunk's f32 logits,
  planned to ``LINEAR_KERNEL_STATS_BYTES`` and rounded down to a multiple of 256 (the
  kernel's row block; at least 256, at most ``num_tokens``)."""
  return _multiple(chunk_size(num_tokens, num_columns, None, 32 * LINEAR_KERNEL_STATS_BYTES),
                   256, num_tokens)


def linear_kernel_tiles(num_tokens: int, num_columns: int, requested_chunk: int | None = None,
                        requested_block: int | None = None) -> tuple[int, int]:
  """``(chunk, block)`` of the fused backward with the Mosaic GPU kernels:
  :func:`linear_tiles`' plan, the chunk rounded down to a multiple of 256 and the block
  to one of 128 (the kernel's tile; at least that, at most the array)."""
  chunk, block = linear_tiles(num_tokens, num_columns, requested_chunk, requested_block)
  return _multiple(chunk, 256, num_tokens), _multiple(block, 128, num_columns)


def linear_backward_order(num_tokens: int, num_columns: int,
                          hidden_grad_accumulation: str = "float32") -> str:
  """The loop order of the fused backward: ``"vocab"`` (vocab blocks outer: ``d hidden``
  sums in an f32 ``[T, D]`` array) or ``"token"`` (token chunks outer: ``d W`` sums in an
  f32 array like the weight, ``[D, V_local]``), whichever sum is smaller, so the memory
  beyond the outputs stays flat in T. ``hidden_grad_accumulation="output"`` keeps the
  vocab order, which then needs no f32 sum at all."""
  if hidden_grad_accumulation == "output" or num_tokens <= num_columns:
    return "vocab"
  return "token"


def _multiple(size: int, multiple: int, total: int) -> int:
  return min(max(size - size % multiple, multiple), total)


def platform(*arrays, mesh=None) -> str:
  """The platform a call runs on: its mesh's devices', else those of the first array
  placed on devices, else (traced arrays) JAX's default backend."""
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:  # (an AbstractMesh has none)
    return mesh.devices.flat[0].platform
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      return next(iter(a.sharding.device_set)).platform
  return jax.default_backend()


def implementation(requested: str | None, *arrays, mesh=None) -> str:
  """``"pallas"``, ``"xla"`` or ``"mosaic"`` for a call's forward statistics over ``arrays``
  (the logits, or the hidden states and the weight; ``"mosaic"`` is the fused path's
  Mosaic GPU kernel, which ``jaxce.linear_logprobs_and_entropy`` puts in place of
  ``"pallas"`` on Hopper GPUs where it can run). ``None``: the Pallas kernel when the call runs on
  GPUs (:func:`platform`) unless an array is float64, inside ``shard_map`` too. Off GPUs
  the kernel runs in JAX's Pallas interpreter (tests only), which cannot run inside
  ``shard_map`` once an operand differs per shard; on GPUs that case is checked by
  ``scripts/gpu_check_sharded_pallas.py``."""
  if requested is None:
    return "pallas" if platform(*arrays, mesh=mesh) == "gpu" and not any(
        a.dtype == jnp.float64 for a in arrays) else "xla"
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f'implementation must be None, "xla", "pallas" or "mosaic", got '
                     f'{requested!r}')
  return requested
