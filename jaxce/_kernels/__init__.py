"""jaxce's kernels: the per-shard computations, on arrays the front door has checked and
flattened to ``[T, ...]``, with a ``Config`` (``config.py``) that holds the planner's
``Plan``. Nothing here imports the front door, the planner or the shard_map wiring.

Four layers, each importing only the ones below it:

* operations, one module each, a ``jax.custom_vjp`` over chunks of tokens (and vocab
  blocks): ``logits`` (per-token, logits path), ``linear`` (per-token, fused LM head),
  ``logits_kept_ids`` and ``linear_kept_ids`` (the same over kept ids: only their logits
  or columns), ``token_loss`` and
  ``linear_token_loss`` (objectives, gradient formed in the forward);
* shared by them: ``logits_rows`` (full logits rows: statistics by XLA, Mosaic GPU or
  Triton, the
  merge of per-tile statistics by the plan's backend, the gradient), ``head`` (the LM
  head's tile matmuls), ``loss_terms`` (a chunk's loss terms and cotangents), ``merge``
  (the merge contract: per-token outputs from per-tile statistics in one fixed order),
  ``kept_entries`` (the kept-ids kernels' shared maths);
* backends, a package each (``mosaic/``, ``triton/``), one kernel a module, imported from
  JAX when first used, imported by the others as ``mosaic_<module>`` / ``triton_<module>``
  (``mosaic.tile``: the Mosaic kernels' tile maths, swizzles, column segments and kept-set
  words): ``mosaic.rows`` / ``triton.rows`` (row statistics of logits rows in one read;
  Triton only when asked for by name) and ``mosaic.head`` (Pallas Mosaic GPU: the fused
  head's tiles with a statistics or a ``d logits`` epilogue), each saying why it cannot
  run a call (``unsupported``); ``mosaic.rows_grad`` (the rows' gradient, over the logits
  or into a new array); ``mosaic.merge`` / ``triton.merge`` (per-tile statistics merged in
  column order) and ``mosaic.reciprocal`` (``1 / T`` on the device, Hopper); each kernel's
  tiling is a frozen ``Config`` of its module, read from its ``CONFIG``; XLA is plain
  ``jax.numpy`` in the floor below;
* the floor: ``softmax`` (the per-tile maths), ``chunking`` (ragged chunks without
  copies), ``plumbing`` (shard_map varying types, symbolic zeros, named custom_vjp
  arguments, lazy backends), ``config`` (Tokens, Plan, Config).
"""
