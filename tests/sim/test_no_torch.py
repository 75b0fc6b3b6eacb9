"""kvserve.core and kvserve.sim never import torch (docs/architecture.md, "Layers")."""

import subprocess
import sys

BLOCK_TORCH = """
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None

sys.meta_path.insert(0, _Block())
import kvserve.core, kvserve.sim, kvserve.sim.plan, kvserve.sim.html, kvserve.cli
from kvserve.cli import build_parser
build_parser()
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
print("ok")
"""


def test_sim_imports_without_torch():
    done = subprocess.run([sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
