"""The planner: how a call runs, decided in one place.

Every public function checks its arguments once, then, where the shard's shapes are known
(on this device, or inside ``shard_map`` for each shard), asks :func:`make` for one
:class:`Plan`: the backend of the forward statistics, the tiles, the backward's loop
order. The kernels take that plan and never re-derive it. A local call, the same call
inside ``shard_map`` with ``vocab_axis``, a ``sharded_*`` call and a call on arrays split
over explicit mesh axes get the same plan for the same per-shard shapes.

See what a call will use, and why, without running it:

    jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels)
    # Plan(backend='mosaic', reason='...', chunk=..., block=..., ...)

The tile sizes are public too, for benchmarks and notebooks (``num_columns`` is the
vocabulary a device holds, ``V_local`` when it is split; every budget is per platform and
bench/NOTES.md has the measurements behind each number):

    jaxce.plan.logits_chunk(num_tokens, num_columns)           # logits path
    jaxce.plan.linear_tiles(num_tokens, num_columns)           # fused path: (chunk, block)
    jaxce.plan.linear_backward_order(num_tokens, num_columns)  # "vocab" or "token"
    jaxce.plan.linear_objective_chunk(num_tokens, num_columns) # linear_token_loss: rows
    jaxce.plan.linear_objective_grad_chunk(num_tokens, num_columns, chunk)  # and d's rows

Example (on a CPU, where XLA runs every call; on a Hopper GPU the same call plans the
Mosaic kernels, batch-invariant by construction):

  >>> import jax, jax.numpy as jnp
  >>> import jaxce
  >>> hidden = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
  >>> weight = jax.ShapeDtypeStruct((1024, 32768), jnp.bfloat16)
  >>> labels = jax.ShapeDtypeStruct((4096,), jnp.int32)
  >>> plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels)
  >>> plan.backend, plan.invariant_to
  ('xla', ())
  >>> jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels,
  ...               batch_invariant=True).invariant_to
  ('tokens', 'chunking', 'differentiation', 'constants', 'shards')
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxce._kernels import mosaic_head, mosaic_rows, triton_rows
from jaxce._kernels.config import BACKEND_NAMES, Backend, Plan

__all__ = [
    "IMPLEMENTATIONS", "INVARIANCES", "Plan", "Target", "budget_platform", "chunk_size",
    "invariances", "kept_ids_unsupported", "linear_backward_order",
    "linear_kernel_chunk", "linear_kernel_tiles", "linear_objective_chunk",
    "linear_objective_grad_chunk", "linear_objective_kernel_tiles", "linear_tiles",
    "logits_chunk", "make", "matmul_precision", "of", "target",
]

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
# ... and, where the fused head's forward kernel writes the rows, what one more group
# costs against the kernel's rows: a pass over the f32 d W sum (4 D V bytes read and
# written) takes about as long as the kernel on 3 row blocks of 256 (2 D V flop each).
LINEAR_OBJECTIVE_GROUP_ROWS = 3 * 256
# Fused path, Mosaic GPU forward: bytes of one chunk's f32 [V_local / 128, 4, chunk] tile
# statistics (1/32 of its f32 [chunk, V_local] logits).
LINEAR_KERNEL_STATS_BYTES = 256 * 2**20
# Fused path, Mosaic GPU backward (linear_kernel_tiles; bench/NOTES.md, entry 25): bytes
# of one [T, block] tile of d logits in the operand dtype (written by the d-logits kernel,
# read by the two gradient GEMMs), the block's bounds in columns (past the largest the
# GEMMs gain little for the memory), and the time of one more block's passes per T x D, in
# _kernel_block_cost's units (measured: 0.57 ms per block at T = 32768, D = 4096, H100).
LINEAR_KERNEL_GRAD_BYTES = 576 * 2**20
LINEAR_KERNEL_MIN_BLOCK, LINEAR_KERNEL_MAX_BLOCK = 4096, 8448
LINEAR_KERNEL_BLOCK_PASS = 2.7e-4

# Kept ids (jaxce.keep.from_csr), every path: only the kept columns' logits when their
# entries (and the labels) are at most this fraction of the T x V_local logits; above it,
# the whole rows (or head) on packed words. Where the two forms cost the same, on one H100
# (bench/NOTES.md, "Where kept ids stop paying"): the fused head at about 1/560 (each
# entry a D-long gather, dot and two scatter-adds; the head's logits cost a D-long matmul
# column each), the logits path at about 1/150 (each entry one logit's read and write).
KEPT_IDS_FRACTION = {"fused": 1 / 560, "logits": 1 / 150}

# Batch-invariant fused paths: (rows, columns) of every forward hidden @ weight matmul,
# one shape per platform whatever the call (a matmul's rows and columns depend on its
# shape, not on their neighbours or their position in it: tests/test_batch_invariant.py).
# The forward holds one f32 [rows, V_local] chunk of logits.
INVARIANT_MATMUL_TILE = {"gpu": (512, 8192), "cpu": (32, 128)}

# The backends: "triton" is Pallas on Triton (JAX deprecates that backend: it runs only when
# asked for by name), "mosaic" Pallas on Mosaic GPU (Hopper). "pallas" is the old name of
# "triton".
IMPLEMENTATIONS = BACKEND_NAMES
ALIASES = {"pallas": "triton"}
# The backends each operation has, in the order the default tries them on GPUs (XLA runs
# every call, so the default never reaches a backend listed after it).
BACKENDS = {
    "logprobs_and_entropy": ("mosaic", "xla", "triton"),
    "token_loss": ("mosaic", "xla", "triton"),
    "linear_logprobs_and_entropy": ("mosaic", "xla", "triton"),
    "linear_token_loss": ("mosaic", "xla", "triton"),
}


class Target(NamedTuple):
  """Where a call runs: its platform (``"gpu"``, ``"cpu"``...), its GPUs' compute
  capability (``"9.0"`` on Hopper; ``None`` elsewhere) and their streaming
  multiprocessors (the Mosaic kernels' persistent grid; 4 off GPUs, for the interpreter)."""
  platform: str
  capability: str | None
  num_cores: int


def target(*arrays, mesh=None) -> Target:
  """The :class:`Target` of a call over ``arrays``: its mesh's devices, else those of the
  first array placed on devices, else (traced arrays) JAX's default backend."""
  device = None
  if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:  # (an AbstractMesh has none)
    device = mesh.devices.flat[0]
  for a in arrays:
    if device is None and isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      device = next(iter(a.sharding.device_set))
  platform = jax.default_backend() if device is None else device.platform
  if platform != "gpu":
    return Target(platform, None, 4)
  device = device or jax.devices()[0]
  return Target(platform, getattr(device, "compute_capability", None),
                getattr(device, "core_count", None) or 132)


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
                                  itemsize: int = 2) -> tuple[int, int]:
  """``(chunk, grad_chunk)`` of the fused objective path when the fused head's forward
  kernel writes its rows (``mosaic_head``: calls of a multiple of 8 rows, at least 256;
  each costs its rows rounded up to 256). A requested chunk is rounded up to that, its
  groups as :func:`linear_objective_grad_chunk` plans them. Else: all ``T`` (rounded up
  to the kernel's rows) when its f32 rows fit ``LINEAR_OBJECTIVE_ROWS_BYTES``; otherwise
  the fewest groups that the d logits' budget (``LINEAR_OBJECTIVE_GRAD_BYTES``) allows,
  each of ``k`` equal chunks within the rows' budget, ``k`` the count (of the four
  smallest that fit) whose chunks waste the fewest kernel rows. The groups then cover
  ``T`` with fewer than 8 rows to spare a chunk: the last group is clamped back over that
  many rows (or ``T`` padded up to one group)."""
  rows_of = mosaic_head.padded_rows  # (a call's rows: a multiple of 8, at least 256)
  if requested is not None:
    chunk = rows_of(requested)
    return chunk, linear_objective_grad_chunk(max(num_tokens, chunk), num_columns, chunk,
                                              platform, itemsize)
  platform = budget_platform(platform)
  rows_cap = rows_of(LINEAR_OBJECTIVE_ROWS_BYTES[platform] // (4 * max(num_columns, 1)) - 7)
  group_cap = LINEAR_OBJECTIVE_GRAD_BYTES[platform] // (itemsize * max(num_columns, 1))
  tokens = rows_of(num_tokens)
  if tokens <= rows_cap:
    return tokens, tokens
  block = mosaic_head.MIN_ROWS
  fewest_groups = -(-tokens // max(group_cap, rows_cap))

  def cost(groups, count):  # (kernel rows, then a d W pass as LINEAR_OBJECTIVE_GROUP_ROWS)
    chunk = rows_of(-(-tokens // (groups * count)))
    return groups * count * -(-chunk // block) * block + groups * LINEAR_OBJECTIVE_GROUP_ROWS

  fewest_chunks = lambda groups: -(-tokens // (groups * rows_cap))  # (a group's)
  candidates = [(groups, count) for groups in range(fewest_groups, fewest_groups + 4)
                for count in range(fewest_chunks(groups), fewest_chunks(groups) + 4)]
  groups, count = min(candidates, key=lambda c: (cost(*c), c))
  chunk = rows_of(-(-tokens // (groups * count)))
  return chunk, chunk * count


def linear_kernel_chunk(num_tokens: int, num_columns: int) -> int:
  """Tokens per call of the fused path's Mosaic GPU forward kernel: its tile statistics
  take 1/32 of the bytes of the chunk's f32 logits, planned to
  ``LINEAR_KERNEL_STATS_BYTES``: all ``num_tokens`` when they fit, else the fewest, most
  even chunks (``_kernel_chunk``: a multiple of the kernel's 256-row block; the rows left
  take one call of their own)."""
  cap = 32 * LINEAR_KERNEL_STATS_BYTES // (4 * max(num_columns, 1))
  return _kernel_chunk(num_tokens, cap)


def linear_kernel_tiles(num_tokens: int, num_columns: int, requested_chunk: int | None = None,
                        requested_block: int | None = None, platform: str | None = None, *,
                        depth: int = 4096, num_cores: int = 132) -> tuple[int, int]:
  """``(chunk, block)`` of the fused backward with the Mosaic GPU kernels.

  The token chunks are walked exactly (``linear.row_chunks``: equal chunks, then the rows
  left in one call), so a chunk is all ``T`` tokens or a multiple of the kernel's row
  block (``mosaic_head.MIN_ROWS``, 256), and no row is computed twice. With vocab blocks
  outer (``T <= V_local``) and neither size requested, the chunk is all ``T`` tokens when
  a block of at least ``LINEAR_KERNEL_MIN_BLOCK`` columns fits the budget
  (``LINEAR_KERNEL_GRAD_BYTES`` for the ``[T, block]`` d logits in the operand dtype):
  each block's ``d hidden`` then adds into its f32 sum inside the GEMM, with no row
  slices and no partial ``d W`` sums; when it does not, the fewest, most even chunks
  within :func:`linear_tiles`' budget (``_kernel_chunk``). With token chunks outer, the
  fewest, most even chunks whose tile with the largest block fits that budget: fewer,
  larger chunks add each block's ``d W`` sum fewer times. A requested chunk (or
  :func:`linear_tiles`' chunk for a requested block) is rounded down to a multiple of 256
  (all ``T`` when it is at least ``T``). Unless a size is requested, the block is the
  multiple of 128 between half the budget for ``[chunk, block]`` and the budget (at most
  ``LINEAR_KERNEL_MAX_BLOCK``) with the least ``_kernel_block_cost`` on ``num_cores`` SMs
  for a hidden dim ``depth``; else :func:`linear_tiles`' block, rounded down to a multiple
  of 128 (at least that, at most the array).
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
  elif planned:  # (vocab blocks outer, several chunks: linear_tiles' budget)
    chunk = _kernel_chunk(num_tokens, LINEAR_TILE_BYTES[budget_platform(platform)] // (4 * block))
  elif chunk < num_tokens:
    chunk = _multiple(chunk, mosaic_head.MIN_ROWS, num_tokens)
  if planned:
    cap = min(LINEAR_KERNEL_GRAD_BYTES // (2 * chunk), LINEAR_KERNEL_MAX_BLOCK, num_columns)
    blocks = range(max(step, cap // 2 - cap // 2 % step), max(step, cap - cap % step) + 1, step)
    block = min(blocks, key=lambda b: (_kernel_block_cost(chunk, num_columns, depth, b,
                                                          num_cores), -b))
  return chunk, _multiple(block, step, num_columns)


def _kernel_chunk(num_tokens: int, cap: int) -> int:
  """Tokens per chunk of the Mosaic kernels' calls: all ``T`` when they are at most
  ``cap``, else the least multiple of 256 rows (the kernels' row block) that covers ``T``
  in as few chunks as ``cap`` allows (at most ``cap`` rounded down to 256; at least 256).
  The chunks are walked exactly (``linear.row_chunks``), the last taking the rows left."""
  if num_tokens <= cap:
    return num_tokens
  step = mosaic_head.MIN_ROWS
  cap = max(step, cap - cap % step)
  count = -(-num_tokens // cap)
  return min(-(-num_tokens // (count * step)) * step, cap)


def _kernel_block_cost(num_tokens: int, num_columns: int, depth: int, block: int,
                       num_cores: int) -> float:
  """The Mosaic backward's time with ``[T, block]`` tiles, in units of one SM's ``[256,
  128]`` output tile per hidden dim. Per block (the last one is clamped back, a whole
  block): the d-logits kernel's and the ``d W`` GEMM's waves of ``[256, 128]`` tiles over
  ``num_cores`` SMs (``K = D`` and ``K = T``), the ``d hidden`` GEMM's (``K = block``), and
  ``LINEAR_KERNEL_BLOCK_PASS`` per ``T x D`` (its pass over the f32 sum, set-up)."""
  waves = lambda tiles: -(-tiles // max(num_cores, 1))
  column_tiles = block // mosaic_head.TILE_N
  per_block = (waves(-(-num_tokens // mosaic_head.MIN_ROWS) * column_tiles) * depth
               + waves(-(-depth // 256) * column_tiles) * num_tokens
               + waves(-(-num_tokens * depth // (256 * 128))) * block
               + LINEAR_KERNEL_BLOCK_PASS * num_tokens * depth)
  return -(-num_columns // block) * per_block


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


# The kernels whose outputs are batch-invariant by construction (each backend names its
# operations): each token's statistics come from the same instructions whatever the call
# (fixed tiles, no split-K, one program), its tiles are merged in the columns' order by
# ``mosaic_merge`` or ``triton_merge``, as the backend (vocab shards gathered in rank
# order) and ``1 / temperature`` is computed on the device (``mosaic_reciprocal`` on
# Hopper, else XLA's division behind an optimization barrier). What each plan's bits do
# not depend on
# (``Plan.invariant_to``):
INVARIANCES = ("tokens", "chunking", "differentiation", "constants", "shards")
KERNEL_INVARIANCES = {
    (operation, backend): INVARIANCES[:4]
    for backend, modules in (("triton", (triton_rows,)), ("mosaic", (mosaic_head, mosaic_rows)))
    for module in modules
    for operation in module.INVARIANT_OPERATIONS
}


def invariances(operation: str, backend: Backend, batch_invariant: bool) -> tuple[str, ...]:
  """What a call's per-token bits do not depend on, on ``backend`` (a subset of
  ``INVARIANCES``): ``"tokens"`` (the number of tokens, a token's position and its
  neighbours), ``"chunking"`` (``chunk_size``, ``vocab_block_size``, the planner's
  chunks), ``"differentiation"`` (forward only or under ``jax.grad``), ``"constants"``
  (whether the caller's ``jit`` passes an array or closes over it), ``"shards"`` (the
  number of vocab shards). The kernels of ``KERNEL_INVARIANCES`` hold theirs in either
  mode; XLA's exact sums (``batch_invariant=True``) hold all five; XLA's default sums
  promise none."""
  if (operation, backend) in KERNEL_INVARIANCES:
    return KERNEL_INVARIANCES[operation, backend]
  return INVARIANCES if backend == "xla" and batch_invariant else ()


def _unsupported(backend, *, operation, target, dtypes, has_bias, has_keep, depth,
                 num_columns, batch_invariant):
  """Why ``backend``'s kernel cannot run a call (a sentence), or None: each backend's
  module says for itself (XLA runs every call: with ``batch_invariant``, by exact sums)."""
  if backend == "triton":
    return triton_rows.unsupported(operation=operation, dtypes=dtypes, has_keep=has_keep,
                                   batch_invariant=batch_invariant)
  if backend == "mosaic" and operation.startswith("linear"):
    # (the fused head's kernels; the objective path's rows from them, or else from XLA's
    # matmul with their statistics by the logits rows' kernel)
    head_reason = _head_unsupported(target, dtypes, has_bias, depth, num_columns)
    if operation == "linear_logprobs_and_entropy" or head_reason is None:
      return head_reason
  if backend == "mosaic":  # (the statistics of logits rows; the fused objective's are f32)
    rows_dtype = jnp.float32 if operation == "linear_token_loss" else dtypes[0]
    return mosaic_rows.unsupported(
        operation=operation, platform=target.platform, capability=target.capability,
        dtypes=(*dtypes, rows_dtype), num_columns=num_columns,
        batch_invariant=batch_invariant)
  return None


def _head_unsupported(target, dtypes, has_bias, depth, num_columns):
  """Why the fused head's kernels (``mosaic_head``) cannot run a fused call, or None."""
  return mosaic_head.unsupported(
      platform=target.platform, capability=target.capability, hidden_dtype=dtypes[0],
      weight_dtype=dtypes[1], has_bias=has_bias, depth=depth or 1, num_columns=num_columns)


def _backend(operation, requested, **call):
  """``(backend, reason)`` of a call: the requested one (a ``ValueError`` when it cannot
  run the call, with the reason), else on GPUs the first of the operation's backends that
  can run it, else XLA."""
  backends = BACKENDS[operation]
  if requested is not None:
    if requested not in backends:
      return _refuse(requested, f"{operation} has no {requested} kernel (it has "
                                f"{', '.join(backends)})")
    reason = _unsupported(requested, operation=operation, **call)
    if reason:
      return _refuse(requested, reason)
    return requested, "asked for"
  if call["target"].platform != "gpu":
    return "xla", (f"the call runs on {call['target'].platform}: the Pallas kernels run "
                   "there only interpreted (tests)")
  skipped = []
  for backend in backends:
    reason = _unsupported(backend, operation=operation, **call)
    if reason is None:
      because = "; ".join(skipped)
      return backend, f"the fastest that runs this call on GPUs{': ' if because else ''}{because}"
    skipped.append(f"not {backend}: {reason}")
  raise AssertionError("XLA runs every call")  # (xla is every operation's last backend)


def _refuse(requested, reason):
  raise ValueError(f'implementation="{requested}" cannot run this call: {reason}')


def make(operation: str, *, target: Target, implementation: str | None, num_tokens: int,
         num_columns: int, dtypes: tuple, depth: int | None = None, has_bias: bool = False,
         has_keep: bool = False, chunk_size: int | None = None,
         vocab_block_size: int | None = None, hidden_grad_accumulation: str = "float32",
         backward_in_place: bool = False, batch_invariant: bool = False,
         num_kept_ids: int | None = None, precision: str | None = None) -> Plan:
  """The :class:`Plan` of one shard's call.

  Args:
    operation: the public function's name without ``sharded_`` (``"logprobs_and_entropy"``,
      ``"linear_logprobs_and_entropy"``, ``"token_loss"``, ``"linear_token_loss"``).
    target: where it runs (:func:`target`).
    implementation: ``None`` or a backend (``"pallas"`` is accepted for ``"triton"``).
    num_tokens, num_columns: ``T`` and this shard's ``V_local``.
    dtypes: the dtypes of the logits, or of hidden and the weight.
    depth, has_bias: the fused paths' ``D`` and whether a bias is added.
    has_keep: whether the call has kept sets (``keep=``).
    chunk_size, vocab_block_size, hidden_grad_accumulation, backward_in_place,
      batch_invariant: the public options of the same names.
    num_kept_ids: with kept ids (``jaxce.keep.from_csr``), their number ``N``.
    precision: the fused paths' ``precision=`` (a ``jax.lax.Precision`` name), or None:
      JAX's ``jax_default_matmul_precision`` now (the call is being traced).

  Raises:
    ValueError: the requested implementation cannot run the call (the message says why).
  """
  if implementation is not None:
    implementation = ALIASES.get(implementation, implementation)
  if operation.startswith("linear"):
    precision = matmul_precision(precision)
  packed_ids = ""  # (kept ids packed into words: why)
  if num_kept_ids is not None:
    packed_ids = (kept_ids_unsupported(operation, num_tokens, num_columns, num_kept_ids,
                                       batch_invariant)
                  or (None if implementation in (None, "xla") else
                      f'implementation="{implementation}" takes packed words'))
    if packed_ids is None:
      return _recorded_plan(Plan(
          backend="xla", reason=f"kept ids: {num_kept_ids} entries for {num_tokens} tokens, "
          "only their columns' logits", interpret=target.platform != "gpu",
          num_cores=target.num_cores, kept_ids=True, precision=precision))
    packed_ids = f"; kept ids packed into words: {packed_ids}"
  chosen, reason = _backend(operation, implementation, target=target, dtypes=dtypes,
                             has_bias=has_bias, has_keep=has_keep, depth=depth,
                             num_columns=num_columns, batch_invariant=batch_invariant)
  reason += packed_ids
  platform = target.platform
  exact = batch_invariant and chosen == "xla"  # XLA's exact sums
  matmul_tile = None
  if exact and operation.startswith("linear"):
    matmul_tile = INVARIANT_MATMUL_TILE[budget_platform(platform)]
  common = dict(backend=chosen, reason=reason, interpret=platform != "gpu", precision=precision,
                num_cores=target.num_cores, exact_sums=exact, matmul_tile=matmul_tile,
                invariant_to=invariances(operation, chosen, batch_invariant))
  one_pass = chosen in ("mosaic", "triton")  # (the logits path's kernels read every row)
  if operation == "logprobs_and_entropy":
    uses_chunks = not one_pass or backward_in_place
    chunk = logits_chunk(num_tokens, num_columns, chunk_size, platform) if uses_chunks else None
    plan = Plan(chunk=chunk, **common)
  elif operation == "token_loss":
    chunk = None if one_pass else logits_chunk(num_tokens, num_columns, chunk_size, platform)
    plan = Plan(chunk=chunk, **common)
  elif operation == "linear_token_loss":  # (exact sums: the matmul's rows a chunk, a group)
    itemsize = jnp.dtype(jnp.result_type(*dtypes)).itemsize
    head_reason = (_head_unsupported(target, dtypes, has_bias, depth, num_columns)
                   if chosen == "mosaic" else "")
    if head_reason is None:  # the rows and their statistics from the fused head's kernel
      chunk, grad_chunk = linear_objective_kernel_tiles(num_tokens, num_columns, chunk_size,
                                                        platform, itemsize)
      plan = Plan(chunk=chunk, grad_chunk=grad_chunk, kernel_chunk=chunk, **common)
    else:
      if head_reason:
        common.update(reason=f"{reason}; the rows from XLA's matmul: {head_reason}",
                      invariant_to=())
      chunk = (matmul_tile[0] if exact else
               linear_objective_chunk(num_tokens, num_columns, chunk_size, platform))
      grad_chunk = chunk if exact else linear_objective_grad_chunk(
          num_tokens, num_columns, chunk, platform, itemsize)
      plan = Plan(chunk=chunk, grad_chunk=grad_chunk, **common)
  else:
    if chosen == "mosaic":  # (padded to the kernels' multiple of 8 rows, at least 256)
      num_tokens = mosaic_head.padded_rows(num_tokens)
      chunk, block = linear_kernel_tiles(num_tokens, num_columns, chunk_size, vocab_block_size,
                                         platform, depth=depth or 1, num_cores=target.num_cores)
    else:
      chunk, block = linear_tiles(num_tokens, num_columns, chunk_size, vocab_block_size,
                                  platform)
    plan = Plan(chunk=chunk, block=block,
                kernel_chunk=(linear_kernel_chunk(num_tokens, num_columns)
                              if chosen == "mosaic" else None),
                backward_order=linear_backward_order(num_tokens, num_columns,
                                                     hidden_grad_accumulation), **common)
  return _recorded_plan(plan)


def matmul_precision(precision: str | None = None) -> str:
  """The matmul precision a fused call uses, as ``jax.lax.Precision``'s lower-case name:
  ``precision`` when given, else JAX's ``jax_default_matmul_precision`` where the call is
  traced (``"default"`` when unset), as ``jnp.dot`` would; a setting that names no
  ``Precision`` (an algorithm) is kept as written."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision or "default"
  try:
    return jax.lax.Precision(precision).name.lower()
  except ValueError:
    return str(precision)


def kept_ids_unsupported(operation: str, num_tokens: int, num_columns: int, num_kept_ids: int,
                         batch_invariant: bool) -> str | None:
  """Why a call with kept ids packs them into words (a sentence), or None when it computes
  only their columns' logits (every operation; the objectives through the per-token
  kept-ids kernels): ``N + T`` entries (the labels count) at most ``KEPT_IDS_FRACTION``
  (the fused paths' or the logits paths') of the ``T x V_local`` logits."""
  if batch_invariant:
    return "batch_invariant=True takes kept sets as packed words (exact sums)"
  fraction = KEPT_IDS_FRACTION["fused" if operation.startswith("linear_") else "logits"]
  if (num_kept_ids + num_tokens) > fraction * num_tokens * num_columns:
    share = f"1/{round(1 / fraction)}" if fraction else "none"
    return (f"{num_kept_ids} kept ids for {num_tokens} tokens over {num_columns} columns "
            f"(more than {share} of the logits): all the columns cost less")
  return None


def _recorded_plan(plan):
  """``plan``, or (inside :func:`of`) recorded and the trace stopped."""
  if _recorded is not None:
    _recorded.append(plan)
    raise _Planned
  return plan


_recorded: list | None = None


class _Planned(Exception):
  """Stops a call traced by :func:`of` once its plan is made."""


def of(function, *args, **kwargs) -> Plan:
  """The :class:`Plan` that ``function(*args, **kwargs)`` (one of jaxce's public
  functions, or a function that makes one such call) runs with, and why (its ``reason``).
  Nothing is computed: the call is traced up to its plan. Arrays may be given as
  ``jax.ShapeDtypeStruct`` (traced, so they run where JAX's default backend does).

  Raises:
    ValueError: as the call would (bad arguments, an implementation that cannot run it),
      or the function planned no jaxce call, or several.
  """
  global _recorded
  leaves, tree = jax.tree.flatten((args, kwargs))
  shapes = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]

  def call(*traced):
    for i, x in zip(shapes, traced):
      leaves[i] = x
    call_args, call_kwargs = jax.tree.unflatten(tree, leaves)
    return function(*call_args, **call_kwargs)

  previous, _recorded = _recorded, []
  try:
    with contextlib.suppress(_Planned):
      jax.eval_shape(call, *(leaves[i] for i in shapes))
    plans = _recorded
  finally:
    _recorded = previous
  if len(plans) != 1:
    raise ValueError(f"expected a call that runs one jaxce operation, it planned {len(plans)}")
  return plans[0]
