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


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float64_stays_on():
  """A test that turns JAX's x64 mode off (directly or through code it calls) would make
  every later test in its worker compare float32 results at float64 tolerances: fail it
  where it happens."""
  yield
  assert jax.config.read("jax_enable_x64"), "this test left jax_enable_x64 off"
