"""mxtrain without Triton: the README's first command installs ``.[data]`` on a CPU build of torch, which brings no
Triton, so every module must import and a converted model must train a step without it (the kernels and the
compiled forms are then simply unavailable). The tests' environment has Triton (``dev``), so a child process
blocks its import."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r'''
import importlib, importlib.abc, pathlib, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("Triton is not installed (blocked by the test)")
sys.meta_path.insert(0, NoTriton())
root = pathlib.Path(sys.argv[1])
TRITON_ONLY = {"mxtrain.kernels.mxdot"}   # a Triton kernel module, imported only where it runs
bad = []
for p in sorted((root / "mxtrain").rglob("*.py")):
    parts = list(p.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__main__":
        continue
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if ".".join(parts) in TRITON_ONLY:
        continue
    try:
        importlib.import_module(".".join(parts))
    except Exception as e:
        bad.append(f"{'.'.join(parts)}: {type(e).__name__}: {e}")
assert not bad, bad
import torch, mxtrain
from mxtrain.model.llama import Llama, ModelConfig
torch.manual_seed(0)
m = Llama(ModelConfig.named("tiny", vocab_size=256))
mxtrain.convert(m, "mxfp4-all-dh16")
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
idx = torch.randint(0, 256, (2, 33))
loss = m(idx[:, :-1], idx[:, 1:])
loss.backward()
opt.step()
assert torch.isfinite(loss) and "triton" not in sys.modules
print("ok")
'''


def test_every_module_imports_and_a_model_trains_without_triton():
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT)], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
