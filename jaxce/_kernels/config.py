"""The records a kernel takes, ``(operands, tokens, config)``: the per-token arrays
(``Tokens``, a pytree), the ``Plan`` the planner (``jaxce.plan``) made for one shard's
shapes, and the ``Config`` of one call (the checked options and that plan).

``Plan`` (a frozen dataclass, one per operation) and ``Config`` (a NamedTuple) are
hashable: the kernels are jitted with them as static arguments, so a new value compiles
a new program and an equal one reuses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, NamedTuple, get_args

from jaxce._kernels import chunking


# The kernels' backends (``jaxce.plan.IMPLEMENTATIONS``): XLA, Pallas on Triton, Pallas on
# Mosaic GPU.
Backend = Literal["xla", "triton", "mosaic"]
BACKEND_NAMES = get_args(Backend)


class Operation(NamedTuple):
  """A public operation: its name (``jaxce.plan.BACKENDS``' keys: the public function's
  name without ``sharded_``), whether it takes ``(hidden, weight)`` (else logits), whether
  it is an objective (a scalar loss and per-token metrics, else per-token outputs), and
  its kernel (``jaxce._dispatch`` defines the four)."""
  name: str
  fused: bool
  is_objective: bool
  kernel: Callable


class Tokens(NamedTuple):
  """The per-token arrays of a call (or of one chunk of it), flattened: one pytree through
  ``jit``, ``scan`` and ``custom_vjp``, sliced by :meth:`rows`.

  Attributes:
    labels: int32 ``[T]`` global label ids (negative: ignored).
    inv_temp: ``[T]`` ``1 / temperature`` in the compute dtype.
    valid: bool ``[T]``: the tokens not ignored (``where`` and labels ``>= 0``).
    kept: uint32 ``[T, V_local / 32]``, the tokens' kept sets (``keep=``), or None.
  """
  labels: Any
  inv_temp: Any
  valid: Any
  kept: Any = None

  def rows(self, start, size: int) -> "Tokens":
    """Tokens ``[start, start + size)`` (``start`` may be traced)."""
    return chunking.take_rows(self, start, size)

  def padded(self, total: int) -> "Tokens":
    """With tokens appended up to ``total``: label 0, temperature 1, ``valid`` False (so
    they are ignored), nothing kept. A matmul of a fixed shape keeps it when a call has
    fewer tokens than its rows."""
    return Tokens(chunking.pad_rows(self.labels, total), chunking.pad_rows(self.inv_temp, total, 1),
                  chunking.pad_rows(self.valid, total, False), chunking.pad_rows(self.kept, total))


class KeptIds(NamedTuple):
  """Kept sets as kept column ids (``jaxce.keep.from_csr``): one entry per kept id,
  sorted by token, then id; the same kept set as the packed words of ``jaxce.keep.pack``
  that ``keep=`` also takes, at ``O(N)`` memory instead of ``O(T V / 32)``.

  Attributes:
    ids: int32 ``[N]`` global column ids; -1 marks an unused entry (padding, a repeat).
    token: int32 ``[N]``: the flattened token (in the order of the labels) of each id.
  """
  ids: Any
  token: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """How one shard's call runs, decided once by ``jaxce.plan.make``; kernels never
  re-derive any of it. The head every operation's plan shares: :class:`LogitsPlan`
  (``logprobs_and_entropy``, ``token_loss``), :class:`FusedPlan`
  (``linear_logprobs_and_entropy``) and :class:`ObjectivePlan` (``linear_token_loss``)
  add their own fields, each with one meaning. Frozen and hashable: the kernels are
  jitted with it as a static argument.

  Attributes:
    backend: ``"xla"``, ``"triton"`` (Pallas Triton) or ``"mosaic"`` (Pallas Mosaic GPU):
      the forward statistics' implementation (and, with ``"mosaic"``, the fused
      backward's ``d logits`` tiles).
    reason: why this backend (a sentence, for ``jaxce.plan.of``).
    interpret: run the Pallas kernels in JAX's interpreter (the call runs off GPUs).
    num_cores: streaming multiprocessors of the device (the Mosaic kernels' persistent
      grid).
    exact_sums: XLA's forward statistics take exact sums (``softmax.exact_statistics``):
      each token's bits depend on its own inputs only (``batch_invariant=True`` where no
      batch-invariant kernel runs the call).
    invariant_to: what the call's per-token bits do not depend on (``jaxce.plan.
      invariances``): some of ``"tokens"``, ``"chunking"``, ``"differentiation"``,
      ``"constants"``, ``"shards"``; empty where nothing is promised.
    kept_ids: the call computes only the kept columns' logits (``linear_kept_ids``,
      ``logits_kept_ids``; an objective through them under autodiff); else kept ids, if
      any, are packed into words first.
    reciprocal: how ``1 / temperature`` is computed: ``"xla"`` (XLA's division: a Python
      number, or off GPUs, or not float32), ``"barrier"`` (XLA's division behind an
      optimization barrier, so a constant folds as an argument computes) or ``"mosaic"``
      (``mosaic_reciprocal``'s kernel, on Hopper).
    mask_vocab: ``vocab_size=`` where some of the columns lie at or beyond it (a padded
      vocabulary: the kernels mask them), else ``None`` (no column is masked).
  """
  backend: Backend
  reason: str
  interpret: bool = True
  num_cores: int = 4
  exact_sums: bool = False
  invariant_to: tuple[str, ...] = ()
  kept_ids: bool = False
  reciprocal: str = "xla"
  mask_vocab: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogitsPlan(Plan):
  """The logits paths' plan (``logprobs_and_entropy``, ``token_loss``): the head, and

  Attributes:
    chunk: tokens per step of the XLA forward's scan and of the in-place backward's loop,
      or ``None`` where no loop over tokens runs (the one-pass kernels).
    in_place: the backward overwrites the logits (``backward_in_place``): ``"kernel"``
      (``mosaic_rows_grad.overwrite``: the Mosaic plan with ``T`` a multiple of 8 and
      rows TMA tiles, ``mosaic_rows.tiled``) or ``"chunks"`` (a loop over the chunks);
      ``None``: the gradient is a new array.
    kept_grad_kernel: the gradient's pass over the rows with kept sets (into a new array)
      is ``mosaic_rows_grad.gradient``'s kernel, which reads the kept words with its
      tiles (the Mosaic plan with ``T`` a multiple of 8 and rows TMA tiles); else XLA's
      fused pass.
  """
  chunk: int | None = None
  in_place: str | None = None
  kept_grad_kernel: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearPlan(Plan):
  """What the fused paths' plans add to the head.

  Attributes:
    precision: the matmul precision, a ``jax.lax.Precision`` name (``"default"``,
      ``"high"``, ``"highest"``): the call's ``precision=``, else JAX's
      ``jax_default_matmul_precision`` when it was traced (``"default"`` when unset; on
      GPUs TF32 for float32 operands). The Mosaic kernels multiply 16-bit operands, for
      which every precision is exact.
    matmul_tile: with ``exact_sums``, ``(rows, columns)`` of every forward ``hidden @
      weight`` matmul, the same for every call on the platform (a matmul's rows depend on
      its shape); else ``None``.
    rows: the tokens as the kernels run them: ``T``, or ``T`` with ignored rows appended
      (the Mosaic per-token path: a multiple of 8, at least 256; the objective path: at
      least one ``grad_chunk``).
  """
  precision: str | None = None
  matmul_tile: tuple[int, int] | None = None
  rows: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedPlan(LinearPlan):
  """The fused per-token path's plan (``linear_logprobs_and_entropy``): the head, the fused
  paths' fields (:class:`LinearPlan`), and

  Attributes:
    chunk: the tile's rows (with ``"mosaic"``, all ``T`` or a multiple of 256: the
      backward walks equal chunks, then the rows left in one call).
    chunks: the backward's token chunks over ``rows`` (``chunking.RowChunks``): equal
      chunks of ``chunk`` rows, then the rows left (with ``"mosaic"``, at least its
      kernels' 256), every row in one chunk.
    block: vocabulary columns per tile.
    own_blocks: every vocab block holds columns of its own, the last as wide as the
      columns left (``"mosaic"``); else a ragged vocabulary's last block is clamped back
      over the one before, its overlap given exact zeros.
    unrolled_blocks: the backward (token-outer) unrolls its blocks, each with a ``d W`` sum
      of its own added inside its GEMM (``"mosaic"``, up to
      ``jaxce.plan.MAX_UNROLLED_BLOCKS`` blocks); else it scans them into one sum like the
      weight.
    kernel_chunk: tokens per call of the Mosaic forward kernel (``mosaic_head``): all
      ``T`` or a multiple of 256 (the rows left take one call of their own); ``None``
      on the other backends.
    kernel_chunks: those calls' chunks over ``rows`` (as ``chunks``), or ``None``.
    backward_order: the backward's outer loop, ``"vocab"`` or ``"token"``.
  """
  chunk: int | None = None
  chunks: chunking.RowChunks | None = None
  block: int | None = None
  own_blocks: bool = False
  unrolled_blocks: bool = False
  kernel_chunk: int | None = None
  kernel_chunks: chunking.RowChunks | None = None
  backward_order: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectivePlan(LinearPlan):
  """The fused objective path's plan (``linear_token_loss``): the head, the fused paths'
  fields (:class:`LinearPlan`), and

  Attributes:
    chunk: the rows whose full vocabulary is held at once.
    grad_chunk: tokens per pair of gradient matmuls, a multiple of ``chunk``.
    kernel_chunk: with the fused head's kernel, its tokens per call (``chunk``, a group,
      whose ``exp(z - m)`` terms the kernel writes with their statistics); else ``None``.
    weight_copy: where the kernel copies a weight it cannot read in place into vocab
      blocks (``mosaic_head.reads_in_blocks``): ``"call"``, once a call, before the
      groups (``mosaic_head.weight_blocks``: about the weight's bytes, alive until the
      last group); ``"group"``, in each group's kernel call, one block alive at a time;
      ``None``, no copy (the kernel reads the weight in place, or XLA's matmul runs).
  """
  chunk: int | None = None
  grad_chunk: int | None = None
  kernel_chunk: int | None = None
  weight_copy: str | None = None


class Gathered(NamedTuple):
  """The token-split layout's gather (``plumbing.gather_rows``): the mesh ``axes`` the
  hidden states were gathered over, in the order it names them, and ``rows``, each
  device's own rows as the kernels see them, its tokens flattened (``B * S`` for its
  ``[B, S, D]``; the gathered ``[T, D]``'s first ``rows * n``)."""
  axes: tuple
  rows: int


class Config(NamedTuple):
  """The static configuration of one kernel call.

  Attributes:
    plan: the shard's plan (the operation's ``Plan``: ``LogitsPlan``, ``FusedPlan`` or
      ``ObjectivePlan``).
    vocab_size: the logical vocabulary (kept labels at or above it give NaN).
    vocab_axis: the mesh axis (or tuple) the columns are split over, or ``None``.
    with_entropy: compute (and return) the entropy.
    logit_softcap: ``c`` of ``c * tanh(x / c)`` (fused paths), or ``None``.
    vocab_dim: the fused weight's vocabulary dim (``weight_layout``: 1 for ``"dv"``,
      ``[D, V]``; 0 for ``"vd"``, ``[V, D]``), the index its kernels take.
    hidden_grad_accumulation: where the fused backward sums ``d hidden``: ``"float32"``
      (an f32 buffer) or ``"output"`` (in its own dtype).
    gathered: how ``plumbing.gather_rows`` gathered the hidden states (the token-split
      layout), or None: the fused backward sums ``d hidden`` over those axes too
      (``plumbing.sum_over_shards``).
  """
  plan: Plan
  vocab_size: int
  vocab_axis: object
  with_entropy: bool
  logit_softcap: float | None = None
  vocab_dim: int = 1
  hidden_grad_accumulation: str = "float32"
  gathered: Gathered | None = None
