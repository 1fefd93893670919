"""jaxce's kernels: the per-shard computations, on arrays the front door has checked and
flattened to ``[T, ...]``, with a ``Config`` (``config.py``) that holds the planner's
``Plan``. Nothing here imports the front door, the planner or the shard_map wiring.

Three layers, each importing only the ones below it:

* operations, one module each, a ``jax.custom_vjp`` over chunks of tokens (and vocab
  blocks): ``logits`` (per-token, logits path), ``linear`` (per-token, fused LM head),
  ``token_loss`` and ``linear_token_loss`` (objectives, gradient formed in the forward);
* backends, one module each, that say why they cannot run a call (``unsupported``):
  ``triton_rows`` (Pallas Triton row statistics), ``mosaic_head`` (Pallas Mosaic GPU:
  the fused head's tiles with a statistics or a ``d logits`` epilogue); XLA is plain
  ``jax.numpy`` in the floor below;
* the floor: ``softmax`` (the per-tile maths), ``head`` (the LM head's tile matmuls),
  ``rows`` (full logits rows: statistics and gradient, by XLA or Triton), ``objective``
  (a chunk's loss terms and cotangents), ``chunking`` (ragged chunks without copies),
  ``plumbing`` (shard_map varying types, symbolic zeros), ``config`` (Plan, Config).
"""
