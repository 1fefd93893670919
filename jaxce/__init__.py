"""jaxce: per-token log-probabilities and entropies over huge vocabularies, in bounded memory."""

from jaxce import plan, reference
from jaxce._api import (linear_logprobs_and_entropy, logprobs_and_entropy,
                        sharded_linear_logprobs_and_entropy, sharded_logprobs_and_entropy)

__version__ = "0.1.0"

__all__ = [
    "linear_logprobs_and_entropy",
    "logprobs_and_entropy",
    "plan",
    "reference",
    "sharded_linear_logprobs_and_entropy",
    "sharded_logprobs_and_entropy",
]
