"""jaxce: per-token log-probabilities and entropies over huge vocabularies, in bounded memory.

The package, top to bottom (each layer imports only the ones below it):

* the public functions (``_api``): eight thin signatures with their docstrings;
* the dispatcher (``_dispatch``, with ``_options`` and ``_checks``): checks a call once
  into typed options and runs each operation through one path, on this device's arrays,
  inside the caller's ``shard_map`` or over a mesh (``_sharded``: specs only, no maths);
* the planner (``plan``, public): per shard, one ``Plan`` (backend, tiles, loop order);
* the kernels (``_kernels``): one module per operation and per backend, over a floor of
  shared maths (softmax statistics, the LM head's tile, ragged chunks, JAX's type
  plumbing). Kernels take a ``Plan`` and import nothing above them.
"""

from jaxce import keep, objectives, plan, reference
from jaxce._api import (linear_logprobs_and_entropy, linear_token_loss, logprobs_and_entropy,
                        sharded_linear_logprobs_and_entropy, sharded_linear_token_loss,
                        sharded_logprobs_and_entropy, sharded_token_loss, token_loss)

__version__ = "0.1.0"

__all__ = [
    "keep",
    "linear_logprobs_and_entropy",
    "linear_token_loss",
    "logprobs_and_entropy",
    "objectives",
    "plan",
    "reference",
    "sharded_linear_logprobs_and_entropy",
    "sharded_linear_token_loss",
    "sharded_logprobs_and_entropy",
    "sharded_token_loss",
    "token_loss",
]
