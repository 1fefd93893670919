"""The Pallas Triton kernels (GPUs; only when asked for by name), one a module; each loads
``jax.experimental.pallas.triton`` when first used (``plumbing.lazy_module``), so this
package imports nothing. Imported as ``triton_<module>`` (``from jaxce._kernels.triton
import rows as triton_rows``), clear of ``jaxce._kernels.merge``:

* ``rows``: one-pass softmax statistics of logits rows (the logits path's forward, and
  the fused path's vocab blocks);
* ``merge``: per-tile statistics merged in column order into each token's outputs.
"""
