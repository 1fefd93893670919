"""The planner's budgets: how many tokens and vocabulary columns one step of each path
takes, from per-platform byte budgets (the constants below, each with the measurement
behind it in bench/NOTES.md) and the kernels' row blocks. Pure functions of shapes: the
planner (``jaxce.plan.make``) calls them with one shard's ``T`` and ``V_local``, and
``jaxce.plan`` exports them for benchmarks and notebooks.
"""

from __future__ import annotations

import jax

from jaxce._kernels.mosaic import head as mosaic_head, rows_grad as mosaic_rows_grad

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
# ... and bytes of one group's d logits in the operand dtype: the chunks of a group feed
# one pair of gradient matmuls, so the f32 d W sum is read and written once per group
# (bench/NOTES.md, entry 26: groups of 4096 tokens at V = 151936).
LINEAR_OBJECTIVE_GRAD_BYTES = {"gpu": 5 * 2**28, "cpu": 4 * 2**20}
# With the fused head's kernel (linear_objective_kernel_tiles) a group's d takes at most
# this many times the bytes of the f32 [D, V_local] d W sum, which each group reads and
# writes once: fewer, larger groups run faster, each holding more d (bench/NOTES.md,
# entry 39).
LINEAR_OBJECTIVE_GRAD_PER_SUM = {"gpu": 1.0, "cpu": 1.0}
# ... and, where the kernel copies its weight out in vocab blocks (mosaic_head.
# reads_in_blocks: a segment or width TMA cannot read in place), the most bytes of that
# copy made once a call, before the groups, alive until the last (mosaic_head.
# weight_blocks), against a copy a group, one block alive at a time. A copy a group costs
# about 100 / group of the call's time (bench/NOTES.md, entry 81, one H200: 2.6-3.1 % at
# Qwen3's 151936 columns, D = 1024, groups of 2048, for 0.22 GiB; 1.5-1.7 % at D = 2048
# and 4096, groups of 4096, for 0.52 and 1.11 GiB): the budget takes the first.
LINEAR_OBJECTIVE_COPY_BYTES = {"gpu": 2**29, "cpu": 2**20}
# Fused path, Mosaic GPU forward: bytes of one chunk's f32 [V_local / 128, 4, chunk] tile
# statistics (1/32 of its f32 [chunk, V_local] logits).
LINEAR_KERNEL_STATS_BYTES = 256 * 2**20
# Fused path, Mosaic GPU backward (linear_kernel_tiles; bench/NOTES.md, entry 25): bytes
# of one [T, block] tile of d logits in the operand dtype (written by the d-logits kernel,
# read by the two gradient GEMMs), the block's bounds in columns (past the largest the
# GEMMs gain little for the memory), and the time of one more block's passes per T x D, in
# _kernel_block_cost's units (measured: 0.57 ms per block at T = 32768, D = 4096, H100).
# With one chunk, past a hidden dim of LINEAR_KERNEL_WIDE_DEPTH the largest block grows
# with D (entry 40: twice the block was 2 % faster at D = 4096, T = 8192, for 12 % more
# memory; 0.8 % at D = 2048 for 19 % more; no faster at D = 1024), but only while that
# block's tile stays within LINEAR_KERNEL_WIDE_GRAD_BYTES (entries 88 and 91, one H200: at
# T = 16192, D = 4096, 16896 -> 8448 columns peaked 0.34 GiB lower in the same time; XLA's
# plans 0.07-0.45 GiB smaller at ten shapes, 1.000-1.013x the time).
LINEAR_KERNEL_GRAD_BYTES = 576 * 2**20
LINEAR_KERNEL_MIN_BLOCK, LINEAR_KERNEL_MAX_BLOCK = 4096, 8448
LINEAR_KERNEL_WIDE_DEPTH = 2048
LINEAR_KERNEL_WIDE_GRAD_BYTES = 256 * 2**20
LINEAR_KERNEL_BLOCK_PASS = 2.7e-4


def budget_platform(platform: str | None = None) -> str:
  """The budgets' key for ``platform`` (JAX's default backend when ``None``): ``"cpu"``,
  or ``"gpu"`` for every other platform. (Not a kernel backend: that is ``Plan.backend``.)"""
  if platform is None:
    platform = jax.default_backend()
  return "cpu" if platform == "cpu" else "gpu"


def chunk_size(num_tokens: int, num_columns: int, requested: int | None,
               tile_bytes: int) -> int:
  """Tokens per step: ``min(requested, T)``, or the largest chunk whose f32
  ``[chunk, num_columns]`` tile fits ``tile_bytes``, moved down to a divisor of T if one
  lies within a factor 2 (so no ragged last chunk), else to the least multiple of 8 that
  covers T in as few steps (a clamped last chunk then repeats fewer than 8 rows a step),
  and T itself when all of it fits."""
  if requested is not None:
    return min(requested, num_tokens)
  cap = max(1, min(num_tokens, tile_bytes // (4 * max(num_columns, 1))))
  if cap == num_tokens:
    return cap  # one chunk: rounding it down would only add a step
  if cap >= 8:
    cap -= cap % 8
  return _divisor_near(num_tokens, cap, 8 if cap >= 8 else 1)


def _divisor_near(total: int, cap: int, multiple: int = 1) -> int:
  """The largest divisor of ``total`` in ``[cap / 2, cap]``, else the least multiple of
  ``multiple`` (``cap`` is one) that covers ``total`` in ``ceil(total / cap)`` steps: steps
  of that size cover ``total`` with no ragged last step when a divisor lies within a
  factor 2, and otherwise overlap by fewer than ``multiple`` items a step (``cap``
  itself could overlap by almost a whole step)."""
  for size in range(cap, max(cap // 2, 1) - 1, -1):
    if total % size == 0:
      return size
  even = -(-total // -(-total // cap))
  return -(-even // multiple) * multiple


def logits_chunk(num_tokens: int, num_columns: int, requested: int | None = None,
                 platform: str | None = None) -> int:
  """Tokens per step of the logits path's XLA forward and in-place backward
  (``LOGITS_TILE_BYTES`` of ``platform``, JAX's default backend when ``None``)."""
  return chunk_size(num_tokens, num_columns, requested,
                    LOGITS_TILE_BYTES[budget_platform(platform)])


def linear_tiles(num_tokens: int, num_columns: int, requested_chunk: int | None = None,
                 requested_block: int | None = None,
                 platform: str | None = None) -> tuple[int, int]:
  """``(chunk, block)`` of the fused path: ``block = min(requested_block or
  DEFAULT_VOCAB_BLOCK, num_columns)``, the chunk planned for a ``[chunk, block]`` tile
  of ``LINEAR_TILE_BYTES`` of ``platform``."""
  block = min(requested_block or DEFAULT_VOCAB_BLOCK, num_columns)
  return chunk_size(num_tokens, block, requested_chunk,
                    LINEAR_TILE_BYTES[budget_platform(platform)]), block


def linear_objective_chunk(num_tokens: int, num_columns: int, requested: int | None = None,
                           platform: str | None = None) -> int:
  """Tokens per step of the fused objective path, whose full ``[chunk, num_columns]``
  rows are held at once (``LINEAR_OBJECTIVE_ROWS_BYTES`` of ``platform``)."""
  return chunk_size(num_tokens, num_columns, requested,
                    LINEAR_OBJECTIVE_ROWS_BYTES[budget_platform(platform)])


def linear_objective_grad_chunk(num_tokens: int, num_columns: int, chunk: int,
                                platform: str | None = None, itemsize: int = 2) -> int:
  """Tokens per pair of gradient matmuls of the fused objective path: a multiple of its
  ``chunk`` whose ``[grad_chunk, num_columns]`` d logits (``itemsize`` bytes each) fit
  ``LINEAR_OBJECTIVE_GRAD_BYTES`` of ``platform``, at most the whole chunks in ``T``, moved
  down to a count of chunks that divides ``T``'s when one lies within a factor 2 (so no
  group is clamped back over the one before), else to the fewest even groups (the clamped
  last group repeats the fewest chunks)."""
  whole_chunks = max(1, num_tokens // chunk)
  budget = LINEAR_OBJECTIVE_GRAD_BYTES[budget_platform(platform)]
  cap = max(1, min(whole_chunks, budget // (itemsize * chunk * max(num_columns, 1))))
  return chunk * _divisor_near(-(-num_tokens // chunk), cap)


def linear_objective_kernel_tiles(num_tokens: int, num_columns: int,
                                  requested: int | None = None, platform: str | None = None,
                                  itemsize: int = 2, depth: int | None = None
                                  ) -> tuple[int, int]:
  """``(chunk, grad_chunk)`` of the fused objective path when the fused head's forward
  kernel writes its rows' ``exp(z - m)`` terms (``mosaic_head``), both the group: one
  kernel call per group, whose terms become its ``d`` in place
  (``mosaic_rows_grad.exp_overwrite``).

  A group is a multiple of that kernel's row block (``mosaic_rows_grad.CONFIG.rows``, 64), at
  least the head kernel's (``mosaic_head.CONFIG.min_rows``, 256; a call's work is its rows
  rounded up to 256). Its ``[group, num_columns]`` terms in the operand dtype
  (``itemsize`` bytes) fit ``LINEAR_OBJECTIVE_GRAD_BYTES`` of ``platform`` and, given the
  hidden dim ``depth``, ``LINEAR_OBJECTIVE_GRAD_PER_SUM`` of ``platform`` times the bytes
  of the f32 ``[depth, num_columns]`` ``d W`` sum. All ``T`` (rounded up to a block) when
  it fits, else the fewest equal groups, the last clamped back over the one before by
  less than a block (or ``T`` padded up to one group). A requested size is the group,
  rounded up to a block."""
  block = mosaic_rows_grad.CONFIG.rows
  round_up = lambda rows: max(-(-rows // block) * block, mosaic_head.CONFIG.min_rows)
  if requested is not None:
    return round_up(requested), round_up(requested)
  platform = budget_platform(platform)
  budget = LINEAR_OBJECTIVE_GRAD_BYTES[platform]
  if depth is not None:
    budget = min(budget, int(LINEAR_OBJECTIVE_GRAD_PER_SUM[platform] * 4 * depth * num_columns))
  cap = max(budget // (itemsize * max(num_columns, 1)) // block * block,
            mosaic_head.CONFIG.min_rows)
  group = round_up(-(-num_tokens // -(-num_tokens // cap)))
  return group, group


def linear_objective_weight_copy(num_groups: int, copy_bytes: int | None,
                                 platform: str | None = None) -> str | None:
  """Where the fused objective path's kernel copies a weight it cannot read in place
  (``copy_bytes``, ``mosaic_head.weight_blocks_bytes``; None: it reads the weight in
  place, and this returns None): ``"call"``, once, before the ``num_groups`` groups, where
  there are several and the copy fits ``LINEAR_OBJECTIVE_COPY_BYTES`` of ``platform``;
  else ``"group"``, each group's call copying a vocab block at a time."""
  if copy_bytes is None:
    return None
  if num_groups > 1 and copy_bytes <= LINEAR_OBJECTIVE_COPY_BYTES[budget_platform(platform)]:
    return "call"
  return "group"


def linear_kernel_chunk(num_tokens: int, num_columns: int, copied_weight_bytes: int = 0) -> int:
  """Tokens per call of the fused path's Mosaic GPU forward kernel: its tile statistics
  take 1/32 of the bytes of the chunk's f32 logits, planned to
  ``LINEAR_KERNEL_STATS_BYTES``, or to ``copied_weight_bytes`` when more: the bytes of a
  weight that each call copies out in vocab blocks (``mosaic_head.reads_in_blocks``; else
  0), so that no call pays more than one pass over the weight for every ``16 * D`` rows of
  matmul (a copy per 14,000 rows cost 3.7 % of the forward at 151643 columns on an H200,
  bench/NOTES.md entry 55) and the statistics never take more than the weight itself.
  All ``num_tokens`` when they fit, else the fewest, most even chunks (``_kernel_chunk``:
  a multiple of the kernel's 256-row block; the rows left take one call of their own)."""
  budget = max(LINEAR_KERNEL_STATS_BYTES, copied_weight_bytes)
  cap = 32 * budget // (4 * max(num_columns, 1))
  return _kernel_chunk(num_tokens, cap)


def linear_kernel_tiles(num_tokens: int, num_columns: int, requested_chunk: int | None = None,
                        requested_block: int | None = None, platform: str | None = None, *,
                        depth: int = 4096, num_cores: int = 132) -> tuple[int, int]:
  """``(chunk, block)`` of the fused backward with the Mosaic GPU kernels.

  The token chunks are walked exactly (the plan's ``chunks``: equal chunks, then the rows
  left in one call), so a chunk is all ``T`` tokens or a multiple of the kernel's row
  block (``mosaic_head.CONFIG.min_rows``, 256), and no row is computed twice. With vocab blocks
  outer (``T <= V_local``) and neither size requested, the chunk is all ``T`` tokens when
  a block of at least ``LINEAR_KERNEL_MIN_BLOCK`` columns fits the budget
  (``LINEAR_KERNEL_GRAD_BYTES`` for the ``[T, block]`` d logits in the operand dtype):
  each block's ``d hidden`` then adds into its f32 sum inside the GEMM, with no row
  slices and no partial ``d W`` sums; when it does not, the fewest, most even chunks
  within :func:`linear_tiles`' budget (``_kernel_chunk``). With token chunks outer, the
  fewest, most even chunks whose tile with the largest block fits that budget: fewer,
  larger chunks add each block's ``d W`` sum fewer times. Where that is one chunk (``T``
  past ``V_local`` but within the budget: 32768 tokens over 18992 columns), the plan is
  the vocab order's one chunk instead (:func:`linear_kernel_backward_order`). A requested
  chunk (or :func:`linear_tiles`' chunk for a requested block) is rounded down to a
  multiple of 256 (all ``T`` when it is at least ``T``). Unless a size is requested, the
  block is the multiple of 128 between a quarter of the budget for ``[chunk, block]`` and
  the budget (at most ``LINEAR_KERNEL_MAX_BLOCK``; with one chunk,
  ``_kernel_max_block(depth, T)``) with the least ``_kernel_block_cost`` on ``num_cores`` SMs
  for a hidden dim ``depth``, the larger of two that cost the same (a shard's narrow
  vocabulary can take a smaller block in even waves: 4224 columns, not 7680, at 37984
  columns, T = 32768, D = 4096, 0.6 % faster on an H200 in 0.26 GiB less, bench/NOTES.md
  entry 71); else
  :func:`linear_tiles`' block, rounded down to a multiple of 128 (at least that, at most
  the array).
  """
  step = mosaic_head.TILE_N
  cap = min(LINEAR_KERNEL_GRAD_BYTES // (2 * num_tokens), LINEAR_KERNEL_MAX_BLOCK, num_columns)
  planned = requested_chunk is None and requested_block is None
  whole = (planned and num_tokens <= num_columns
           and cap >= min(LINEAR_KERNEL_MIN_BLOCK, num_columns))
  chunk, block = linear_tiles(num_tokens, num_columns, requested_chunk, requested_block,
                              platform)
  if whole:
    chunk = num_tokens
  elif planned and num_tokens > num_columns:  # (token chunks outer: the largest block's tile)
    chunk = _kernel_chunk(num_tokens, LINEAR_KERNEL_GRAD_BYTES // (2 * min(
        LINEAR_KERNEL_MAX_BLOCK, num_columns)))
    whole = chunk == num_tokens and cap >= min(LINEAR_KERNEL_MIN_BLOCK, num_columns)
  elif planned:  # (vocab blocks outer, several chunks: linear_tiles' budget)
    chunk = _kernel_chunk(num_tokens, LINEAR_TILE_BYTES[budget_platform(platform)] // (4 * block))
  elif chunk < num_tokens:
    chunk = _multiple(chunk, mosaic_head.CONFIG.min_rows, num_tokens)
  if planned:
    max_block = _kernel_max_block(depth, chunk) if whole else LINEAR_KERNEL_MAX_BLOCK
    cap = min(LINEAR_KERNEL_GRAD_BYTES // (2 * chunk), max_block, num_columns)
    blocks = range(max(step, cap // 4 - cap // 4 % step), max(step, cap - cap % step) + 1, step)
    block = min(blocks, key=lambda b: (_kernel_block_cost(chunk, num_columns, depth, b,
                                                          num_cores), -b))
  return chunk, _multiple(block, step, num_columns)


def _kernel_max_block(depth: int, num_tokens: int) -> int:
  """The largest block of the Mosaic backward at hidden dim ``depth`` with one chunk of
  ``num_tokens``: ``LINEAR_KERNEL_MAX_BLOCK`` up to ``LINEAR_KERNEL_WIDE_DEPTH``, growing
  with ``depth`` past it while its ``[T, block]`` d logits (2-byte operands) stay within
  ``LINEAR_KERNEL_WIDE_GRAD_BYTES`` (a multiple of 128)."""
  block = min(LINEAR_KERNEL_MAX_BLOCK * max(depth, LINEAR_KERNEL_WIDE_DEPTH)
              // LINEAR_KERNEL_WIDE_DEPTH,
              max(LINEAR_KERNEL_MAX_BLOCK, LINEAR_KERNEL_WIDE_GRAD_BYTES // (2 * num_tokens)))
  return block - block % mosaic_head.TILE_N


def _kernel_chunk(num_tokens: int, cap: int) -> int:
  """Tokens per chunk of the Mosaic kernels' calls: all ``T`` when they are at most
  ``cap``, else the least multiple of 256 rows (the kernels' row block) that covers ``T``
  in as few chunks as ``cap`` allows (at most ``cap`` rounded down to 256; at least 256).
  The chunks are walked exactly (the plan's ``chunks``), the last taking the rows left."""
  if num_tokens <= cap:
    return num_tokens
  step = mosaic_head.CONFIG.min_rows
  cap = max(step, cap - cap % step)
  count = -(-num_tokens // cap)
  return min(-(-num_tokens // (count * step)) * step, cap)


def _kernel_block_cost(num_tokens: int, num_columns: int, depth: int, block: int,
                       num_cores: int) -> float:
  """The Mosaic backward's time with ``[T, block]`` tiles, in units of one SM's ``[256,
  128]`` output tile per hidden dim. Per block (the last one counted whole, though the
  kernels run it only as wide as the columns left: the plans this picks are the measured
  ones, bench/NOTES.md entries 40-41): the d-logits kernel's and the ``d W`` GEMM's waves
  of ``[256, 128]`` tiles over ``num_cores`` SMs (``K = D`` and ``K = T``), the ``d
  hidden`` GEMM's (``K = block``), and ``LINEAR_KERNEL_BLOCK_PASS`` per ``T x D`` (its
  pass over the f32 sum, set-up)."""
  waves = lambda tiles: -(-tiles // max(num_cores, 1))
  column_tiles = block // mosaic_head.TILE_N
  per_block = (waves(-(-num_tokens // mosaic_head.CONFIG.min_rows) * column_tiles) * depth
               + waves(-(-depth // 256) * column_tiles) * num_tokens
               + waves(-(-num_tokens * depth // (256 * 128))) * block
               + LINEAR_KERNEL_BLOCK_PASS * num_tokens * depth)
  return -(-num_columns // block) * per_block


def linear_kernel_backward_order(num_tokens: int, num_columns: int, chunk: int,
                                 hidden_grad_accumulation: str = "float32") -> str:
  """:func:`linear_backward_order` for the Mosaic GPU kernels' planned tiles (``chunk``:
  :func:`linear_kernel_tiles`' with neither size requested): ``"vocab"`` where the tokens
  are one chunk. Token chunks outer would then hold both f32 sums, ``d hidden``'s rows of
  that one chunk (all ``T``) and ``d W``'s, where the vocab order holds the first alone and
  writes each block's ``d W`` once in the weight's dtype."""
  if chunk >= num_tokens:
    return "vocab"
  return linear_backward_order(num_tokens, num_columns, hidden_grad_accumulation)


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
