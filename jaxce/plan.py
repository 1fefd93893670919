"""The planner: how a call runs, decided in one place.

Every public function checks its arguments once, then, where the shard's shapes are known
(on this device, or inside ``shard_map`` for each shard), asks :func:`make` for one
:class:`Plan`: the backend of the forward statistics, the tiles, the backward's loop
order, the rows the kernels run on (a tail padded with ignored rows), the logits path's
in-place backward, how ``1 / temperature`` is computed and whether kept ids stay ids. The
dispatcher and the kernels take that plan and never re-derive it. A local call, the same call
inside ``shard_map`` with ``vocab_axis``, a ``sharded_*`` call and a call on arrays split
over explicit mesh axes get the same plan for the same per-shard shapes.

See what a call will use, and why, without running it:

    jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels)
    # Plan(backend='mosaic', reason='...', chunk=..., block=..., ...)

The tile sizes are public too, for benchmarks and notebooks (``num_columns`` is the
vocabulary a device holds, ``V_local`` when it is split; every budget is per platform,
defined in ``jaxce._budgets`` with the measurement behind it in bench/NOTES.md):

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

# The budgets and the tile sizes they give, exported here (jaxce.plan.logits_chunk, ...).
from jaxce._budgets import (  # noqa: F401  pylint: disable=unused-import
    DEFAULT_VOCAB_BLOCK, LINEAR_KERNEL_BLOCK_PASS, LINEAR_KERNEL_GRAD_BYTES,
    LINEAR_KERNEL_MAX_BLOCK, LINEAR_KERNEL_MIN_BLOCK, LINEAR_KERNEL_STATS_BYTES,
    LINEAR_KERNEL_WIDE_DEPTH, LINEAR_KERNEL_WIDE_GRAD_BYTES,
    LINEAR_OBJECTIVE_COPY_BYTES, LINEAR_OBJECTIVE_GRAD_BYTES, LINEAR_OBJECTIVE_GRAD_PER_SUM,
    LINEAR_OBJECTIVE_ROWS_BYTES,
    LINEAR_TILE_BYTES, LOGITS_TILE_BYTES, budget_platform, chunk_size, linear_backward_order,
    linear_kernel_backward_order, linear_kernel_chunk, linear_kernel_tiles, linear_objective_chunk,
    linear_objective_grad_chunk, linear_objective_kernel_tiles, linear_objective_weight_copy,
    linear_tiles, logits_chunk)
from jaxce._kernels import chunking, head, softmax
from jaxce._kernels.mosaic import head as mosaic_head, reciprocal as mosaic_reciprocal
from jaxce._kernels.mosaic import rows as mosaic_rows, tile as mosaic_tile
from jaxce._kernels.triton import rows as triton_rows
from jaxce._kernels.config import (BACKEND_NAMES, Backend, FusedPlan, LinearPlan, LogitsPlan,
                                   ObjectivePlan, Plan)

__all__ = [
    "IMPLEMENTATIONS", "INVARIANCES", "FusedPlan", "LinearPlan", "LogitsPlan", "ObjectivePlan",
    "Plan", "Shard", "Target", "budget_platform", "chunk_size",
    "invariances", "kept_ids_unsupported", "linear_backward_order",
    "linear_kernel_backward_order", "linear_kernel_chunk", "linear_kernel_tiles",
    "linear_objective_chunk", "linear_objective_grad_chunk", "linear_objective_kernel_tiles",
    "linear_objective_weight_copy", "linear_tiles",
    "logits_chunk", "make", "matmul_precision", "of", "target",
]

# Kept ids (jaxce.keep.from_csr), every path: only the kept columns' logits when their
# entries (and the labels) are at most this fraction of the T x V_local logits; above it,
# the whole rows (or head) on packed words. Where the two forms cost the same, on one H100
# (bench/NOTES.md, "Where kept ids stop paying"): the fused head at about 1/560 (each
# entry a D-long gather, dot and two scatter-adds; the head's logits cost a D-long matmul
# column each), the logits path at about 1/150 (each entry one logit's read and write).
KEPT_IDS_FRACTION = {"fused": 1 / 560, "logits": 1 / 150}

# The fused per-token backward with token chunks outer and the Mosaic kernels: up to this
# many vocab blocks are unrolled, each with its own f32 d W sum (added inside its GEMM);
# more (a small requested vocab_block_size), and the other backends' blocks, are walked by
# a scan, their tiles added into one weight-shaped sum (XLA:CPU's schedule keeps unrolled
# blocks' tiles live together).
MAX_UNROLLED_BLOCKS = 64

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


def _unsupported(backend, *, operation, target, dtypes, has_keep, num_columns,
                 batch_invariant, head_reason):
  """Why ``backend``'s kernel cannot run a call (a sentence), or None: each backend's
  module says for itself (XLA runs every call: with ``batch_invariant``, by exact sums).
  ``operation``: the ``Operation`` record; ``head_reason``: why the fused head's kernels
  cannot run it (None: they can; "" for the logits paths)."""
  if backend == "triton":
    return triton_rows.unsupported(operation=operation.name, dtypes=dtypes, has_keep=has_keep,
                                   batch_invariant=batch_invariant)
  if backend == "mosaic" and operation.fused:
    # (the fused head's kernels; the objective path's rows from them, or else from XLA's
    # matmul with their statistics by the logits rows' kernel)
    if not operation.is_objective or head_reason is None:
      return head_reason
  if backend == "mosaic":  # (the statistics of logits rows; the fused objective's are f32)
    rows_dtype = jnp.float32 if operation.fused else dtypes[0]
    reason = mosaic_rows.unsupported(
        operation=operation.name, platform=target.platform, capability=target.capability,
        dtypes=(*dtypes, rows_dtype), num_columns=num_columns,
        batch_invariant=batch_invariant)
    return f"{head_reason}; nor from XLA's matmul: {reason}" if head_reason and reason else reason
  return None


def _head_unsupported(target, dtypes, has_bias, depth, num_columns):
  """Why the fused head's kernels (``mosaic_head``) cannot run a fused call, or None."""
  return mosaic_head.unsupported(
      platform=target.platform, capability=target.capability, hidden_dtype=dtypes[0],
      weight_dtype=dtypes[1], has_bias=has_bias, depth=depth or 1, num_columns=num_columns)


def _backend(operation, requested, **call):
  """``(backend, reason)`` of a call (``operation``: its ``Operation`` record): the
  requested one (a ``ValueError`` when it cannot run the call, with the reason), else on
  GPUs the first of the operation's backends that can run it, else XLA."""
  backends = BACKENDS[operation.name]
  if requested is not None:
    if requested not in backends:
      return _refuse(requested, f"{operation.name} has no {requested} kernel (it has "
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


class Shard(NamedTuple):
  """One shard's call as the planner sees it: what its shapes and arguments say, where
  the dispatcher knows them (on this device, or inside ``shard_map`` for each shard).

  Attributes:
    num_tokens: ``T``, the shard's tokens.
    num_columns: ``V_local``, the shard's vocabulary columns.
    dtypes: the dtypes of the logits, or of hidden and the weight.
    depth: the fused paths' ``D`` (else None).
    has_bias: a bias is added (fused paths).
    num_kept_ids: with kept ids (``jaxce.keep.from_csr``), their number ``N``; else None.
    number_temperature: the temperature is a Python number (a constant in every program).
    num_shards: the number of vocabulary shards (the kernels' segments depend on it:
      ``mosaic_tile.segments``).
  """
  num_tokens: int
  num_columns: int
  dtypes: tuple
  depth: int | None = None
  has_bias: bool = False
  num_kept_ids: int | None = None
  number_temperature: bool = True
  num_shards: int = 1


def make(operation, options, shard: Shard) -> Plan:
  """The plan of one shard's call: the operation's record (:class:`LogitsPlan`,
  :class:`FusedPlan` or :class:`ObjectivePlan`).

  Args:
    operation: the public operation, a ``jaxce._kernels.config.Operation`` record (private,
      hence no annotation): ``name``, the public function's name without ``sharded_``;
      ``fused``, it takes ``(hidden, weight)``; ``is_objective``, it is an objective.
    options: the call's checked options (``jaxce._options.Options``, which imports this
      module, hence no annotation): the implementation
      asked for (``"pallas"`` is read as ``"triton"``), the target, ``chunk_size``,
      ``vocab_block_size``, ``hidden_grad_accumulation``, ``backward_in_place``,
      ``batch_invariant``, ``precision`` (None: JAX's ``jax_default_matmul_precision``
      now, the call being traced) and whether there are kept sets.
    shard: the shard's shapes and arguments (:class:`Shard`).

  Raises:
    ValueError: the requested implementation cannot run the call (the message says why).
  """
  target, num_tokens, num_columns = options.target, shard.num_tokens, shard.num_columns
  record = ((ObjectivePlan if operation.is_objective else FusedPlan) if operation.fused
            else LogitsPlan)
  implementation = options.implementation
  if implementation is not None:
    implementation = ALIASES.get(implementation, implementation)
  batch_invariant = bool(options.batch_invariant)
  head = dict(interpret=target.platform != "gpu", num_cores=target.num_cores,
              reciprocal=_reciprocal(target, shard),
              mask_vocab=(options.vocab_size
                          if options.vocab_size < num_columns * options.vocab_shards else None))
  if operation.fused:
    head.update(precision=matmul_precision(options.precision))
  packed_ids = ""  # (kept ids packed into words: why)
  if shard.num_kept_ids is not None:
    packed_ids = (kept_ids_unsupported(operation.fused, num_tokens, num_columns,
                                       shard.num_kept_ids, batch_invariant)
                  or (None if implementation in (None, "xla") else
                      f'implementation="{implementation}" takes packed words'))
    if packed_ids is None:
      return _recorded_plan(record(
          backend="xla", reason=f"kept ids: {shard.num_kept_ids} entries for {num_tokens} "
          "tokens, only their columns' logits", kept_ids=True, **head,
          **(dict(rows=num_tokens) if operation.fused else {})))
    packed_ids = f"; kept ids packed into words: {packed_ids}"
  head_reason = (_head_unsupported(target, shard.dtypes, shard.has_bias, shard.depth,
                                   num_columns) if operation.fused else "")
  chosen, reason = _backend(operation, implementation, target=target, dtypes=shard.dtypes,
                            has_keep=options.has_keep, num_columns=num_columns,
                            batch_invariant=batch_invariant, head_reason=head_reason)
  exact = batch_invariant and chosen == "xla"  # XLA's exact sums
  head.update(backend=chosen, reason=reason + packed_ids, exact_sums=exact,
              invariant_to=invariances(operation.name, chosen, batch_invariant))
  if not operation.fused:
    plan = _logits_plan(operation, options, shard, head)
  else:
    if exact:
      head.update(matmul_tile=INVARIANT_MATMUL_TILE[budget_platform(target.platform)])
    if operation.is_objective:
      plan = _objective_plan(options, shard, head, head_reason if chosen == "mosaic" else "")
    else:
      plan = _fused_plan(options, shard, head)
  return _recorded_plan(plan)


def _logits_plan(operation, options, shard: Shard, head: dict) -> LogitsPlan:
  """The logits paths' plan: the XLA forward's (and the in-place backward's) chunk; the
  in-place backward, and the gradient with kept sets, by the Mosaic kernels where ``T``
  is whole tiles of 8 rows and TMA tiles the rows (a multiple of 32 bytes)."""
  one_pass = head["backend"] in ("mosaic", "triton")  # (the kernels read every row)
  # (the gradient's kernels stream rows in tiles of 8, in the tiles' swizzle: elsewhere,
  # XLA's pass)
  grad_kernel = (head["backend"] == "mosaic" and shard.num_tokens % 8 == 0
                 and mosaic_rows.tiled(mosaic_tile.segments(shard.num_columns, shard.num_shards),
                                       shard.dtypes[0]))
  in_place = None
  if options.backward_in_place and not operation.is_objective:
    in_place = "kernel" if grad_kernel else "chunks"
  chunk = None
  if not one_pass or in_place:
    chunk = logits_chunk(shard.num_tokens, shard.num_columns, options.chunk_size,
                         options.target.platform)
  # (without a kept set XLA's fused pass, though the kernel takes 0.97x its fwd+bwd time:
  # XLA writes its pass into the logits' buffer where they are dead, as in a training
  # step, and skips an unused entropy's terms; bench/NOTES.md, entry 76)
  kept_grad_kernel = grad_kernel and options.has_keep
  return LogitsPlan(chunk=chunk, in_place=in_place, kept_grad_kernel=kept_grad_kernel, **head)


def _objective_plan(options, shard: Shard, head: dict, head_reason) -> ObjectivePlan:
  """The fused objective path's plan: groups for the fused head's kernel (``head_reason``
  None), else chunks and gradient chunks of XLA's matmul (exact sums: the matmul's rows a
  chunk, a group); ``head_reason`` (a sentence) is added to the reason where the kernels
  run the rows' statistics but not the head."""
  num_tokens, num_columns, platform = shard.num_tokens, shard.num_columns, options.target.platform
  itemsize = jnp.dtype(jnp.result_type(*shard.dtypes)).itemsize
  if head_reason is None:  # the rows and their statistics from the fused head's kernel
    chunk, grad_chunk = linear_objective_kernel_tiles(num_tokens, num_columns,
                                                      options.chunk_size, platform, itemsize,
                                                      shard.depth)
    kernel_chunk = chunk
    weight_dtype = shard.dtypes[-1]
    layout = mosaic_tile.segments(num_columns, shard.num_shards)
    copy_bytes = (mosaic_head.weight_blocks_bytes(layout, shard.depth, weight_dtype)
                  if mosaic_head.reads_in_blocks(num_columns, weight_dtype, options.vocab_dim,
                                                 layout) else None)
    weight_copy = linear_objective_weight_copy(
        chunking.num_chunks(max(num_tokens, grad_chunk), grad_chunk), copy_bytes, platform)
  else:
    if head_reason:
      head = dict(head, reason=f"{head['reason']}; the rows from XLA's matmul: {head_reason}",
                  invariant_to=())
    exact = head["exact_sums"]
    chunk = (head["matmul_tile"][0] if exact else
             linear_objective_chunk(num_tokens, num_columns, options.chunk_size, platform))
    grad_chunk = chunk if exact else linear_objective_grad_chunk(
        num_tokens, num_columns, chunk, platform, itemsize)
    kernel_chunk = weight_copy = None
  return ObjectivePlan(chunk=chunk, grad_chunk=grad_chunk, kernel_chunk=kernel_chunk,
                       weight_copy=weight_copy, rows=max(num_tokens, grad_chunk), **head)


def _fused_plan(options, shard: Shard, head: dict) -> FusedPlan:
  """The fused per-token path's plan: tiles, the Mosaic forward's chunks (rows padded to
  the kernels' multiple of 8, at least 256; the last chunk at least 256 rows too), the
  backward's loop order and how it walks its vocab blocks."""
  num_columns, platform = shard.num_columns, options.target.platform
  rows = shard.num_tokens
  mosaic = head["backend"] == "mosaic"
  kernel_chunk = kernel_chunks = None
  if mosaic:
    rows = mosaic_head.padded_rows(rows)
    chunk, block = linear_kernel_tiles(rows, num_columns, options.chunk_size,
                                       options.vocab_block_size, platform,
                                       depth=shard.depth or 1,
                                       num_cores=options.target.num_cores)
    dtype = shard.dtypes[-1]  # (the weight's)
    copied = mosaic_head.reads_in_blocks(num_columns, dtype, options.vocab_dim,
                                         mosaic_tile.segments(num_columns, shard.num_shards))
    kernel_chunk = linear_kernel_chunk(
        rows, num_columns,
        (shard.depth or 1) * num_columns * jnp.dtype(dtype).itemsize if copied else 0)
    kernel_chunks = _row_chunks(rows, kernel_chunk, mosaic)
  else:
    chunk, block = linear_tiles(rows, num_columns, options.chunk_size,
                                options.vocab_block_size, platform)
  if mosaic and options.chunk_size is None and options.vocab_block_size is None:
    order = linear_kernel_backward_order(rows, num_columns, chunk,
                                         options.hidden_grad_accumulation)
  else:
    order = linear_backward_order(rows, num_columns, options.hidden_grad_accumulation)
  return FusedPlan(chunk=chunk, chunks=_row_chunks(rows, chunk, mosaic), block=block,
                   own_blocks=mosaic,
                   unrolled_blocks=(mosaic and order == "token"
                                    and -(-num_columns // block) <= MAX_UNROLLED_BLOCKS),
                   rows=rows, kernel_chunk=kernel_chunk, kernel_chunks=kernel_chunks,
                   backward_order=order, **head)


def _row_chunks(num_rows: int, chunk: int, mosaic: bool) -> chunking.RowChunks:
  """Equal chunks of ``chunk`` rows, then the rows left (with the Mosaic kernels, at least
  their ``CONFIG.min_rows``), every row in one chunk."""
  min_last = mosaic_head.CONFIG.min_rows if mosaic else 1
  return chunking.exact_chunks(num_rows, chunk, min(min_last, num_rows))


def _reciprocal(target: Target, shard: Shard) -> str:
  """How the call computes ``1 / temperature`` (``Plan.reciprocal``). On GPUs an f32
  array's reciprocal is computed on the device whether the caller's ``jit`` passes the
  array or closes over it (XLA folds a constant's reciprocal on the host, which need not
  round as the device does), so its bits are the same either way: on Hopper by a kernel
  (``"mosaic"``), elsewhere by XLA's division behind an optimization barrier, which
  constant folding does not cross (``"barrier"``). A Python number is a constant in every
  program, and other platforms and dtypes fold nothing differently: XLA's division
  (``"xla"``)."""
  dtype = softmax.compute_dtype(*shard.dtypes)
  if (target.platform != "gpu" or jnp.dtype(dtype) != jnp.float32 or shard.number_temperature
      or not shard.num_tokens):
    return "xla"
  if target.capability == "9.0" and mosaic_reciprocal.plgpu is not None:
    return "mosaic"
  return "barrier"


def matmul_precision(precision: str | None = None) -> str:
  """The matmul precision a fused call uses, as ``jax.lax.Precision``'s lower-case name:
  ``precision`` when given, else JAX's ``jax_default_matmul_precision`` where the call is
  traced (``"default"`` when unset), as ``jnp.dot`` would; a setting that names no
  ``Precision`` (an algorithm) is kept as written."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision or "default"
  try:
    return head.precision_name(precision)
  except ValueError:
    return str(precision)


def kept_ids_unsupported(fused: bool, num_tokens: int, num_columns: int, num_kept_ids: int,
                         batch_invariant: bool) -> str | None:
  """Why a call with kept ids packs them into words (a sentence), or None when it computes
  only their columns' logits (every operation; the objectives through the per-token
  kept-ids kernels): ``N + T`` entries (the labels count) at most ``KEPT_IDS_FRACTION``
  (the fused paths' when ``fused``, else the logits paths') of the ``T x V_local``
  logits."""
  if batch_invariant:
    return "batch_invariant=True takes kept sets as packed words (exact sums)"
  fraction = KEPT_IDS_FRACTION["fused" if fused else "logits"]
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
