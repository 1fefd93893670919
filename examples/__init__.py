"""jaxce in a Flax NNX RL loop: a small causal LM trained with GRPO (see README.md here)."""
