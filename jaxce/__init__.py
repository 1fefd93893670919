"""jaxce: per-token log-probabilities and entropies over huge vocabularies, in bounded memory."""

from jaxce import reference
from jaxce._linear import linear_logprobs_and_entropy
from jaxce._logits import logprobs_and_entropy
from jaxce._sharded import sharded_linear_logprobs_and_entropy, sharded_logprobs_and_entropy

__version__ = "0.1.0"

__all__ = [
    "linear_logprobs_and_entropy",
    "logprobs_and_entropy",
    "reference",
    "sharded_linear_logprobs_and_entropy",
    "sharded_logprobs_and_entropy",
]
