"""pytest's doctests of the documentation pages (``pytest --doctest-glob='*.md' docs``):
on CPU with four simulated devices (the sharded examples split their vocabulary over
them), never the build's copies."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()

collect_ignore_glob = ["_build/*", "notebooks/*"]
collect_ignore = ["conf.py"]  # Sphinx's configuration, not a module to doctest
