"""jaxce: per-token log-probabilities and entropies over huge vocabularies, in bounded memory."""

from jaxce import objectives, plan, reference
from jaxce._api import (linear_logprobs_and_entropy, linear_token_loss, logprobs_and_entropy,
                        sharded_linear_logprobs_and_entropy, sharded_linear_token_loss,
                        sharded_logprobs_and_entropy, sharded_token_loss, token_loss)

__version__ = "0.1.0"

__all__ = [
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
