"""Test setup: 8 simulated CPU devices and float64 for the references.

Both must be set before JAX initialises its backends, so they live here, at import.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Tests check the maths, not TF32 rounding: on GPUs, float32 matmuls default to TF32.
jax.config.update("jax_default_matmul_precision", "highest")
