"""The Pallas Mosaic GPU (Hopper, sm90) kernels, one a module; each loads
``jax.experimental.pallas.mosaic_gpu`` when first used (``plumbing.lazy_module``), so this
package imports nothing. Imported as ``mosaic_<module>`` (``from jaxce._kernels.mosaic
import head as mosaic_head``), clear of ``jaxce._kernels.head`` and ``merge``:

* ``tile``: the kernels' tile maths (a tile's epilogues, swizzles, column segments and
  kept-set words, the records of per-row inputs);
* ``rows``: softmax statistics of logits rows in one read (the logits path's forward);
* ``rows_grad``: their gradient, over the logits (in place), into a new array, or over
  the fused objective path's ``exp(z - m)`` terms;
* ``head``: the fused LM head's tiles with a statistics or a ``d logits`` epilogue;
* ``merge``: per-tile statistics merged in column order into each token's outputs;
* ``reciprocal``: ``1 / temperature`` on the device.
"""
