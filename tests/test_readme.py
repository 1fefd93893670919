"""README's Quickstart runs as a user would paste it: a fresh Python process, default JAX
settings (no float64, no matmul precision set), on CPU."""

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart() -> str:
  """The Python block of README's Quickstart section."""
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  section = readme.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 1, "README's Quickstart should hold one Python block"
  return blocks[0]


def test_readme_quickstart_runs():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_ENABLE_X64", None)
  proc = subprocess.run([sys.executable, "-c", _quickstart()], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = re.search(r"loss (\S+), d hidden \((\d+), (\d+), (\d+)\) bfloat16", proc.stdout)
  assert found, proc.stdout
  assert math.isfinite(float(found[1]))
  assert tuple(map(int, found.groups()[1:])) == (4, 128, 64)
