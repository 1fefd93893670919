"""The public operations: eight thin functions that state their arguments and hand them
to the one dispatcher (``jaxce._dispatch``), which checks them once, plans each shard
(``jaxce.plan``) and runs the kernels (``jaxce._kernels``) locally, inside the caller's
``shard_map`` or over a mesh."""

from __future__ import annotations

from typing import Callable

from jax import Array
from jax.typing import ArrayLike

from jaxce import _dispatch
from jaxce._options import Request

def _keywords_of(function, kw) -> Request:
  """The keyword options of ``function`` with ``kw`` applied, as one record: a TypeError
  names an unknown one (the ``sharded_*`` functions take them as ``**kw``)."""
  defaults = {k: v for k, v in function.__kwdefaults__.items() if k != "vocab_axis"}
  unknown = sorted(set(kw) - set(defaults))
  if unknown:
    raise TypeError(f"{function.__name__} got unexpected keyword argument(s) {unknown}")
  return Request(**{**defaults, **kw})


def logprobs_and_entropy(logits: ArrayLike, labels: ArrayLike, *, temperature=1.0, where=None,
                         vocab_size=None, chunk_size=None, vocab_axis=None, return_entropy=True,
                         implementation=None, backward_in_place=False, keep=None,
                         batch_invariant=False) -> tuple[Array, Array | None]:
  """Per-token log-probability of the label and entropy of softmax(logits / temperature).

  For each token, with ``z = logits / T`` over its columns (those below ``vocab_size``
  and, with ``keep``, in its kept set ``S``) and ``p = softmax(z)``::

      logp    = z[label] - logsumexp(z)
      entropy = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v

  computed in float32 from ``m = max z`` and ``s = sum exp(z - m)``, never from the
  softmax itself; the gradient is ``(onehot(label) - p) / T`` for ``logp`` and
  ``-p (log p + entropy) / T`` for the entropy.

  Args:
    logits: ``[..., V]`` bf16, f16 or f32 (``V = V_local``, this shard's columns, when
      ``vocab_axis`` is set).
    labels: int ``[...]``, global token ids. Negative ids are ignored.
    temperature: float > 0 or float array broadcastable to ``labels.shape``. No gradient.
    where: optional bool array broadcastable to ``labels.shape``; False positions are
      ignored. Ignored positions give log-prob 0, entropy 0 and an exactly zero gradient.
    vocab_size: logical vocabulary when the columns are padded; global column ids
      ``>= vocab_size`` are excluded from the softmax. A kept label ``>= vocab_size`` is a
      ``ValueError`` for concrete inputs and a NaN log-prob under ``jit``.
    chunk_size: tokens per step of the XLA forward's scan and of the XLA
      ``backward_in_place`` loop; ``None`` plans one (``jaxce.plan.logits_chunk``);
      ``>= T`` runs a single pass. The one-pass kernels (Mosaic on Hopper, the default
      there; Triton when asked for) read every row in one pass, as does the default
      backward: there it is not used (and a new value does not recompile).
    vocab_axis: mesh axis name (or tuple) the last dim is split over, when called inside
      ``shard_map`` / ``pmap``. Shard k holds ids ``[k * V_local, (k + 1) * V_local)``.
    return_entropy: when False the entropy is neither computed nor returned (``None``).
    implementation: forward statistics by ``"xla"`` (two fused passes per chunk of
      tokens), ``"mosaic"`` (one pass, a Pallas Mosaic GPU kernel for Hopper; bf16, f16 or
      f32 logits, a vocabulary per device whose rows are a multiple of 32 bytes: 16
      columns in 16 bits, 8 in f32) or ``"triton"`` (one
      pass, a Pallas Triton kernel, on JAX's deprecated Triton backend: only when asked
      for; ``"pallas"`` is its old name). The kernels run interpreted off GPUs (tests).
      ``None``: ``"mosaic"`` on a Hopper GPU where it can run the call, else ``"xla"``,
      the same for every way of calling it (``jaxce.plan.of`` tells which a call takes,
      and why). One that cannot run the call is a ``ValueError`` saying why.
    backward_in_place: ``False`` (default): one fused pass writes the gradient; donated
      logits are reused by XLA, but as an intermediate of a jitted step XLA's GPU plan
      gives the gradient its own buffer. ``True``: the backward overwrites the logits
      with their gradient, so when the logits are dead afterwards (donated, or an
      intermediate of a jitted training step) the gradient takes their buffer; when they
      are still alive XLA copies them first (one more read and write of the logits, no
      more memory). On Hopper (the Mosaic plan, ``T`` a multiple of 8) one kernel does it
      as fast as the fused pass; elsewhere a loop over chunks of tokens, slower on GPUs
      (bench/NOTES.md, entry 10).

    keep: optional uint32 ``[..., ceil(V / 32)]``, each token's kept set (the sampler's
      top-k / top-p / min-p support), packed 32 columns a word (bit ``v % 32`` of word
      ``v // 32``; ``jaxce.keep`` packs and computes them): the softmax runs over the
      kept columns only, the others get exactly zero gradient. With ``vocab_axis`` the
      words of this shard's columns; split over a mesh, the words split with the
      vocabulary (each shard's columns a multiple of 32). A label outside its kept set is
      a data error (``jaxce.keep.check`` finds it): its column counts as kept, so every
      output and gradient stays finite. Or kept ids (``jaxce.keep.from_csr``, a sampler's
      CSR sets over the flattened tokens): only the kept entries of the logits are read
      while the sets are small. ``None``: the full vocabulary. On Hopper the Mosaic GPU
      kernels read the words with their tiles, from a transposed copy (the mask's size,
      made in each pass). Memory: the mask, read tile by tile, never expanded beyond a
      tile; kept ids: ``[N + T]`` arrays.
    batch_invariant: ``True``: each token's ``logp`` and ``entropy`` are the same bits
      whatever the call around it: the other tokens and their number, ``chunk_size``,
      with or without a gradient, whether your ``jit`` passes an array or closes over it
      (README, "Reproducible log-probs"). The GPU kernels hold it by construction (in
      either mode, at no cost); where none runs the call, XLA's exact sums (integer sums
      of fixed-point terms, which also hold across the number of vocab shards; pass
      ``implementation="xla"`` for that everywhere). ``jaxce.plan.of(...).invariant_to``
      says what a call holds. ``False`` (default): the fastest plan.

  Returns:
    ``(logp, entropy)``, float32 arrays of ``labels.shape`` (entropy ``None`` when
    ``return_entropy=False``).

  Memory: the forward keeps the logits plus three ``[T]`` vectors as residuals; its working
  set is O(T) with the Mosaic or Triton kernel and the reductions' partial sums of one
  ``[chunk, V_local]`` tile with XLA. The backward reads the logits once and writes the
  gradient (an array like ``logits``) with no temporaries; see ``backward_in_place`` for
  when that array is the logits' own buffer.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> logits = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))  # [T=2, V=3]
    >>> logp, ent = jaxce.logprobs_and_entropy(logits, jnp.array([0, 2]))
    >>> print(logp)                              # log 0.5, log 0.7
    [-0.6931 -0.3567]
    >>> print(ent)                               # each row's entropy
    [1.0397 0.8018]
    >>> logp, ent = jaxce.logprobs_and_entropy(logits, jnp.array([0, -100]), temperature=2.0)
    >>> print(logp)                              # softmax(logits / 2); label -100 is ignored
    [-0.8814  0.    ]
  """
  request = Request(temperature=temperature, where=where, vocab_size=vocab_size,
                    chunk_size=chunk_size, return_entropy=return_entropy,
                    implementation=implementation, backward_in_place=backward_in_place,
                    keep=keep, batch_invariant=batch_invariant)
  return _dispatch.run(_dispatch.LOGPROBS, (logits,), labels, request,
                       vocab_axis=vocab_axis)


def sharded_logprobs_and_entropy(logits: ArrayLike, labels: ArrayLike, *, mesh, vocab_axis,
                                 batch_axis=None, **kw) -> tuple[Array, Array | None]:
  """:func:`jaxce.logprobs_and_entropy` on global arrays over ``mesh``.

  Args:
    logits: global ``[B, ..., V]``; the last dim is split over ``vocab_axis`` and, with
      ``batch_axis``, the first dim over ``batch_axis``. V must divide by the shard count.
    labels: global int ``[B, ...]`` of global ids.
    mesh: a ``jax.sharding.Mesh``.
    vocab_axis, batch_axis: mesh axis names (or tuples of names).
    **kw: any keyword of :func:`jaxce.logprobs_and_entropy` but ``vocab_axis``; array
      ``temperature`` and ``where`` are broadcast to ``labels.shape`` and split like the
      labels.

  Returns:
    ``(logp, entropy)`` global float32 arrays of ``labels.shape``, split like the labels.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> mesh = jax.make_mesh((jax.device_count(),), ("vocab",))
    >>> logits = jnp.sin(jnp.arange(2 * 8.0)).reshape(2, 8)           # [T=2, V=8]
    >>> labels = jnp.array([3, 7])
    >>> logp, ent = jaxce.sharded_logprobs_and_entropy(logits, labels, mesh=mesh,
    ...                                                vocab_axis="vocab")
    >>> print(logp)                              # as jaxce.logprobs_and_entropy(logits, labels)
    [-2.2095 -1.8232]
  """
  return _dispatch.run(_dispatch.LOGPROBS, (logits,), labels,
                       _keywords_of(logprobs_and_entropy, kw), mesh=mesh,
                       vocab_axis=vocab_axis, batch_axis=batch_axis)


def linear_logprobs_and_entropy(hidden: ArrayLike, weight: ArrayLike, labels: ArrayLike, *,
                                bias=None, logit_softcap=None, temperature=1.0, where=None,
                                vocab_size=None, chunk_size=None, vocab_axis=None,
                                return_entropy=True, vocab_block_size=None,
                                weight_layout="dv", implementation=None,
                                hidden_grad_accumulation="float32", keep=None,
                                batch_invariant=False,
                                precision=None) -> tuple[Array, Array | None]:
  """Per-token log-prob and entropy of ``softmax(softcap(hidden @ weight + bias) / T)``.

  :func:`jaxce.logprobs_and_entropy`'s maths on ``logits = softcap(hidden @ weight +
  bias)``, computed tile by tile (``[chunk, block]`` of ``hidden @ weight``, f32
  accumulation) so that no ``[T, V]`` array exists, forward or backward; the backward
  recomputes each tile and feeds its ``d logits`` to ``d hidden = d @ weightᵀ`` and
  ``d weight = hiddenᵀ @ d``.

  Args:
    hidden: ``[..., D]`` bf16, f16 or f32.
    weight: ``[D, V]`` (``V = V_local`` with ``vocab_axis``), a Flax ``Linear`` kernel;
      or ``[V, D]`` with ``weight_layout="vd"``.
    labels: int ``[...]`` = ``hidden.shape[:-1]``, global ids; negative ids are ignored.
    bias: optional ``[V]``.
    logit_softcap: optional float c > 0: logits become ``c * tanh(logits / c)`` before the
      temperature (Gemma 2 style).
    temperature, where, vocab_size, vocab_axis, return_entropy, keep: as in
      :func:`jaxce.logprobs_and_entropy`.
    batch_invariant: as in :func:`jaxce.logprobs_and_entropy`. On Hopper the Mosaic
      kernels hold it; on XLA's exact sums the forward's matmuls have one shape whatever
      the call (``jaxce.plan.INVARIANT_MATMUL_TILE``: fewer tokens are padded to its rows),
      each chunk of its rows holds its f32 ``[rows, V_local]`` logits, and ``chunk_size``
      and ``vocab_block_size`` steer the backward only.
    chunk_size: tokens per tile; ``None`` plans it (``jaxce.plan.linear_tiles``: an f32
      tile budget per platform). With the Mosaic kernels (``jaxce.plan.linear_kernel_tiles``)
      the plan takes all T tokens as one chunk (up to the token count whose d logits fit
      a budget, then the fewest even chunks of that budget; the rows left take one call
      of their own, so any T costs its own rows) and sizes the vocab block by a model
      of the kernels' waves on the GPU's SMs, for time: a given ``chunk_size`` (rounded
      down to a multiple of 256) holds less memory.
    vocab_block_size: vocab columns per tile; ``None``: ``min(V, 8192)`` (with the Mosaic
      kernels, as planned above).
    weight_layout: ``"dv"`` (``weight`` is ``[D, V]``) or ``"vd"`` (``[V, D]``: tied
      embeddings pass the embedding table itself). Either way the matmuls read the array
      as stored; passing ``embedding.T`` with ``"dv"`` also works but XLA may then copy
      the table and the gradient into the other layout.
    implementation: the forward's statistics of each f32 tile by ``"xla"`` (two fused
      passes over the tile: the max, then the sums) or ``"triton"`` (one pass, the
      Triton kernel of the logits path, on JAX's deprecated Triton backend: only when
      asked for; ``"pallas"`` is its old name), or the whole forward by ``"mosaic"``: one
      Mosaic GPU kernel (Hopper, sm90) that folds each tile of the matmul into the
      statistics in registers, so no f32 tile reaches device memory; for 16-bit
      ``hidden`` and ``weight`` of one dtype, no bias, ``D`` a multiple of 64 (a
      ``ValueError`` says which is missing; any vocabulary per device; any number of
      tokens, padded with up to 7 ignored rows to a multiple of 8, or to 256). Off GPUs
      the kernels run interpreted (tests).
      ``None``: ``"mosaic"`` on a Hopper GPU where it can run, else ``"xla"``, the same
      for every way of calling it (``jaxce.plan.of`` tells which a call takes, and why).
    hidden_grad_accumulation: where the backward sums ``d hidden`` over the vocab blocks
      (and shards). ``"float32"`` (default): an f32 ``[T, D]`` buffer, rounded to
      ``hidden``'s dtype once at the end. ``"output"``: in ``d hidden`` itself, in
      ``hidden``'s dtype, so no f32 ``[T, D]`` buffer exists (``4 T D`` bytes less; with
      the vocabulary split over GPUs it is the largest buffer that does not shrink with
      their number), at the price of one rounding per vocab block of each shard and one
      per shard in the all-reduce (bench/NOTES.md, entry 18, has the measured error). The
      same as ``"float32"`` for float32 ``hidden``.
    precision: the matmuls' precision, as ``jnp.dot``'s argument: ``None`` follows JAX's
      ``jax_default_matmul_precision`` where the call is traced, as ``hidden @ weight``
      would (on GPUs JAX's default runs float32 operands in TF32, a 10-bit mantissa);
      ``"highest"`` runs them in full float32. 16-bit operands
      multiply exactly with float32 accumulation either way. ``jaxce.plan.of`` says which
      precision a call uses.

  Returns:
    ``(logp, entropy)`` float32 of ``labels.shape`` (entropy ``None`` when
    ``return_entropy=False``). Gradients flow to ``hidden``, ``weight`` and ``bias`` in
    their own dtypes.

  Dtypes: the matmuls take ``hidden`` and ``weight`` in their common dtype, as
  ``hidden @ weight`` does (bf16 hidden with an f32 kernel: f32 matmuls, like the
  reference). Each tile is cast on the fly; no converted copy of either array is made.
  For bf16 matmuls with f32 parameters, pass ``kernel.astype(jnp.bfloat16)`` (what Flax's
  ``Linear(dtype=jnp.bfloat16)`` does); its gradient then comes back in f32 through the cast.

  Memory: no ``[T, V]`` array. Forward: two f32 ``[chunk, Vb]`` tiles, the weight block
  being read and O(T). Backward: ``d hidden`` and ``d weight`` (the outputs), two f32
  tiles, and the smaller of (``jaxce.plan.linear_backward_order``) an f32 ``[T, D]``
  accumulator for ``d hidden`` with an f32 ``[D, Vb]`` one for the weight block (none of
  the first with ``hidden_grad_accumulation="output"``), or an f32 accumulator like the
  weight with an f32 ``[chunk, D]`` one: past ``V_local`` tokens, flat in T (with the
  Mosaic kernels, past ``V_local`` tokens that take more than one chunk:
  ``jaxce.plan.linear_kernel_backward_order``).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> hidden = jnp.eye(2)                                             # [T=2, D=2]
    >>> weight = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))  # [D=2, V=3]
    >>> logp, ent = jaxce.linear_logprobs_and_entropy(hidden, weight, jnp.array([0, 2]))
    >>> print(logp)                              # of softmax(hidden @ weight): log 0.5, log 0.7
    [-0.6931 -0.3567]
    >>> logp, ent = jaxce.linear_logprobs_and_entropy(hidden, weight.T, jnp.array([0, 2]),
    ...                                               weight_layout="vd")  # a tied [V, D] table
    >>> print(ent)
    [1.0397 0.8018]
  """
  request = Request(bias=bias, logit_softcap=logit_softcap, temperature=temperature,
                    where=where, vocab_size=vocab_size, chunk_size=chunk_size,
                    return_entropy=return_entropy, vocab_block_size=vocab_block_size,
                    weight_layout=weight_layout, implementation=implementation,
                    hidden_grad_accumulation=hidden_grad_accumulation, keep=keep,
                    batch_invariant=batch_invariant, precision=precision)
  return _dispatch.run(_dispatch.LINEAR_LOGPROBS, (hidden, weight), labels, request,
                       vocab_axis=vocab_axis)


def sharded_linear_logprobs_and_entropy(hidden: ArrayLike, weight: ArrayLike,
                                        labels: ArrayLike, *, mesh, vocab_axis,
                                        batch_axis=None, **kw) -> tuple[Array, Array | None]:
  """:func:`jaxce.linear_logprobs_and_entropy` on global arrays over ``mesh``.

  Args:
    hidden: global ``[B, ..., D]``, the first dim split over ``batch_axis`` if given.
      ``batch_axis`` may share axes with ``vocab_axis`` (last of its names): the
      token-split layout of sequence parallelism, in which each device gathers the hidden
      states of the devices it shares the vocabulary with and ``d hidden`` is
      reduce-scattered back in f32, the replicated layout's bits (docs/guides/sharded.md).
    weight: global ``[D, V]`` (``[V, D]`` with ``weight_layout="vd"``), the vocab split
      over ``vocab_axis``; ``bias`` (in ``kw``) ``[V]`` likewise.
    labels: global int ``[B, ...]``.
    **kw: any keyword of :func:`jaxce.linear_logprobs_and_entropy` but ``vocab_axis``.

  Returns:
    ``(logp, entropy)`` global float32 arrays of ``labels.shape``, split like the labels.
    ``d hidden`` is reduced over ``vocab_axis`` inside (reduce-scattered in the
    token-split layout); ``d weight`` stays split.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> mesh = jax.make_mesh((jax.device_count(),), ("vocab",))
    >>> hidden = jnp.eye(2)                                             # [T=2, D=2]
    >>> weight = jnp.sin(jnp.arange(2 * 8.0)).reshape(2, 8)           # [D=2, V=8]
    >>> logp, ent = jaxce.sharded_linear_logprobs_and_entropy(
    ...     hidden, weight, jnp.array([3, 7]), mesh=mesh, vocab_axis="vocab")
    >>> print(logp)                              # softmax(hidden @ weight), vocab split
    [-2.2095 -1.8232]
  """
  return _dispatch.run(_dispatch.LINEAR_LOGPROBS, (hidden, weight), labels,
                       _keywords_of(linear_logprobs_and_entropy, kw), mesh=mesh,
                       vocab_axis=vocab_axis, batch_axis=batch_axis)


def token_loss(objective: Callable[..., Array], logits: ArrayLike, labels: ArrayLike,
               *token_args: ArrayLike, temperature=1.0, where=None, vocab_size=None,
               chunk_size=None, vocab_axis=None, return_entropy=None, implementation=None,
               keep=None, batch_invariant=False) -> tuple[Array, tuple[Array, Array | None]]:
  """``sum`` over kept tokens of ``objective(logp, entropy, *token_args)``, with its
  gradient formed in the forward pass.

  Args:
    objective: ``(logp, entropy, *token_args) -> terms``, all of one shape: a token's term
      must depend on that token's values alone (elementwise: no mean, sum, sort or matmul
      over tokens; a ``ValueError`` says so). Normalizations are per-token weights among
      ``token_args`` (``jaxce.objectives.token_weights``). Built-ins: ``jaxce.objectives``.
    logits, labels, temperature, where, vocab_size, chunk_size, vocab_axis,
      implementation, keep, batch_invariant: as in :func:`jaxce.logprobs_and_entropy`
      (batch-invariant ``logp`` and ``entropy`` are the same bits as its own).
    *token_args: arrays broadcastable to ``labels.shape`` (advantages, old and reference
      log-probs, weights...); no gradient flows to them.
    return_entropy: ``None``: the entropy is computed (and returned) when the objective
      uses it; ``True``: also for metrics when it does not; ``False``: never (an objective
      that uses it is a ``ValueError``).

  Returns:
    ``(loss, (logp, entropy))``: the float32 scalar loss and, under ``stop_gradient``, the
    per-token log-probs and entropies of ``labels.shape`` (entropy ``None`` when not
    computed). Ignored tokens contribute nothing and get an exactly zero gradient,
    whatever the objective returns for them.

  Under ``jax.grad`` the forward computes the loss and ``d logits``: two passes over the
  logits (the statistics; one elementwise pass that writes the gradient); the backward
  only scales it by the loss's cotangent. Without differentiation no gradient work is
  done. Memory: the gradient (an array like ``logits``) and O(T).

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> import jaxce
    >>> logits = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))  # [T=2, V=3]
    >>> labels, advantages = jnp.array([0, 2]), jnp.array([1.0, -1.0])
    >>> def objective(logp, entropy, advantages):  # per token
    ...   return -advantages * logp
    >>> loss, (logp, entropy) = jaxce.token_loss(objective, logits, labels, advantages)
    >>> print(loss)                              # -(log 0.5) + log 0.7
    0.3365
    >>> grad = jax.grad(lambda x: jaxce.token_loss(objective, x, labels, advantages)[0])
    >>> print(np.round(np.asarray(grad(logits)), 4))  # -advantages * (onehot(label) - p)
    [[-0.5   0.25  0.25]
     [-0.1  -0.2   0.3 ]]
  """
  request = Request(temperature=temperature, where=where, vocab_size=vocab_size,
                    chunk_size=chunk_size, return_entropy=return_entropy,
                    implementation=implementation, keep=keep,
                    batch_invariant=batch_invariant)
  return _dispatch.run(_dispatch.TOKEN_LOSS, (logits,), labels, request,
                       objective=objective, token_args=token_args, vocab_axis=vocab_axis)


def linear_token_loss(objective: Callable[..., Array], hidden: ArrayLike, weight: ArrayLike,
                      labels: ArrayLike, *token_args: ArrayLike, bias=None,
                      logit_softcap=None, temperature=1.0, where=None, vocab_size=None,
                      chunk_size=None, vocab_axis=None, return_entropy=None,
                      weight_layout="dv", implementation=None, keep=None,
                      batch_invariant=False,
                      precision=None) -> tuple[Array, tuple[Array, Array | None]]:
  """:func:`jaxce.token_loss` of ``softcap(hidden @ weight + bias)``, three matmuls for
  the loss and all its gradients.

  Args:
    objective, token_args, return_entropy: as in :func:`jaxce.token_loss`.
    hidden, weight, labels, bias, logit_softcap, temperature, where, vocab_size,
      vocab_axis, weight_layout, keep, batch_invariant, precision: as in
      :func:`jaxce.linear_logprobs_and_entropy` (batch-invariant: ``chunk_size`` is the
      matmul's rows, and ``logp``, ``entropy`` the same bits as its own).
    chunk_size: tokens per step, whose full ``[chunk, V]`` f32 rows are held at once;
      ``None`` plans it (``jaxce.plan.linear_objective_chunk``). The steps' ``d logits``
      (in the operand dtype) gather into groups of whole steps for the two gradient
      matmuls, planned by ``jaxce.plan.linear_objective_grad_chunk``. Where the fused
      head's kernels run, a step is a group (``jaxce.plan.linear_objective_kernel_tiles``:
      a multiple of 64 tokens, at least 256, a given size rounded up to that) and no f32
      row is held.
    implementation: the statistics of each chunk's rows by ``"xla"``, ``"mosaic"`` or
      ``"triton"``, as in :func:`jaxce.logprobs_and_entropy`. Where the fused head's
      kernels run (``"mosaic"`` on Hopper, with the operands
      :func:`jaxce.linear_logprobs_and_entropy` takes there, at any vocabulary width;
      at an odd one the gradient matmuls read a copy of the weight zero-padded to a
      multiple of 64 columns) one kernel call per group
      makes its rows' statistics and their ``exp(z - m)`` terms in the operand dtype, and
      a second writes ``d`` over those terms, so ``logp`` and ``entropy`` are the
      per-token path's bits in either mode (the first on-policy step's ratio is exactly
      1) and ``d`` is as exact as the operand dtype it is written in. Elsewhere
      ``"mosaic"`` reads XLA's rows, and ``batch_invariant=True`` takes XLA's exact sums.

  Returns:
    ``(loss, (logp, entropy))`` as :func:`jaxce.token_loss`.

  Under ``jax.grad`` one pass over chunks of tokens computes, per chunk, ``hidden @ W``
  (matmul 1), the loss terms, each token's cotangent and ``d`` (the logits' gradient),
  and per group of chunks ``d hidden = d @ Wᵀ`` (2) and ``d W += hiddenᵀ @ d`` (3); the
  backward only scales them. Memory: ``d hidden``, ``d weight``, an f32 ``[D, V]``
  accumulator for ``d weight``, one group's ``d`` and (without the fused head's
  kernels) one chunk's f32 rows; no ``[T, V]`` array and nothing else that grows with T.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> hidden = jnp.eye(2)                                             # [T=2, D=2]
    >>> weight = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))  # [D=2, V=3]
    >>> labels, advantages = jnp.array([0, 2]), jnp.array([1.0, -1.0])
    >>> def objective(logp, entropy, advantages):  # with an entropy bonus
    ...   return -advantages * logp - 0.1 * entropy
    >>> loss, (logp, entropy) = jaxce.linear_token_loss(objective, hidden, weight, labels,
    ...                                                 advantages)
    >>> print(loss)                              # 0.3365 - 0.1 * (1.0397 + 0.8018)
    0.1523
    >>> d_hidden, d_weight = jax.grad(
    ...     lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, advantages)[0],
    ...     argnums=(0, 1))(hidden, weight)
    >>> d_weight.shape
    (2, 3)
  """
  request = Request(bias=bias, logit_softcap=logit_softcap, temperature=temperature,
                    where=where, vocab_size=vocab_size, chunk_size=chunk_size,
                    return_entropy=return_entropy, weight_layout=weight_layout,
                    implementation=implementation, keep=keep,
                    batch_invariant=batch_invariant, precision=precision)
  return _dispatch.run(_dispatch.LINEAR_TOKEN_LOSS, (hidden, weight), labels, request,
                       objective=objective, token_args=token_args, vocab_axis=vocab_axis)


def sharded_token_loss(objective: Callable[..., Array], logits: ArrayLike, labels: ArrayLike,
                       *token_args: ArrayLike, mesh, vocab_axis, batch_axis=None,
                       **kw) -> tuple[Array, tuple[Array, Array | None]]:
  """:func:`jaxce.token_loss` on global arrays over ``mesh`` (as
  :func:`jaxce.sharded_logprobs_and_entropy`; ``token_args`` are split like the labels).
  The loss sums over every shard's tokens.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> mesh = jax.make_mesh((jax.device_count(),), ("vocab",))
    >>> logits = jnp.sin(jnp.arange(2 * 8.0)).reshape(2, 8)           # [T=2, V=8]
    >>> labels, advantages = jnp.array([3, 7]), jnp.array([1.0, -1.0])
    >>> loss, (logp, entropy) = jaxce.sharded_token_loss(
    ...     lambda logp, entropy, a: -a * logp, logits, labels, advantages, mesh=mesh,
    ...     vocab_axis="vocab")
    >>> print(loss)                              # 2.2095 - 1.8232
    0.3863
  """
  return _dispatch.run(_dispatch.TOKEN_LOSS, (logits,), labels, _keywords_of(token_loss, kw),
                       objective=objective, token_args=token_args, mesh=mesh,
                       vocab_axis=vocab_axis, batch_axis=batch_axis)


def sharded_linear_token_loss(objective: Callable[..., Array], hidden: ArrayLike, weight: ArrayLike,
                              labels: ArrayLike, *token_args: ArrayLike, mesh, vocab_axis,
                              batch_axis=None, **kw) -> tuple[Array, tuple[Array, Array | None]]:
  """:func:`jaxce.linear_token_loss` on global arrays over ``mesh`` (as
  :func:`jaxce.sharded_linear_logprobs_and_entropy`; ``token_args`` are split like the
  labels). The loss sums over every shard's tokens.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> mesh = jax.make_mesh((jax.device_count(),), ("vocab",))
    >>> hidden = jnp.eye(2)                                             # [T=2, D=2]
    >>> weight = jnp.sin(jnp.arange(2 * 8.0)).reshape(2, 8)           # [D=2, V=8]
    >>> labels, advantages = jnp.array([3, 7]), jnp.array([1.0, -1.0])
    >>> loss, (logp, entropy) = jaxce.sharded_linear_token_loss(
    ...     lambda logp, entropy, a: -a * logp, hidden, weight, labels, advantages,
    ...     mesh=mesh, vocab_axis="vocab")
    >>> print(loss)
    0.3863
  """
  return _dispatch.run(_dispatch.LINEAR_TOKEN_LOSS, (hidden, weight), labels,
                       _keywords_of(linear_token_loss, kw), objective=objective,
                       token_args=token_args, mesh=mesh, vocab_axis=vocab_axis,
                       batch_axis=batch_axis)
