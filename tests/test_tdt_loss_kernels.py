"""NeMo's real numba TDT loss kernels, both families, run through the start-up check on a CPU.

numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) executes the kernels as Python, thread by thread,
on arrays in host memory. A child process sets it up the way the kernels expect a GPU: CPU tensors
stand in for device memory, a no-op stream for torch's CUDA stream, and a warp shuffle the
simulator lacks is implemented over the block's barrier. ``tdt_loss.check_cuda_loss`` then runs
NeMo's TDT kernels (omega 0) and its plain RNN-T kernels (omega 1) against ``tdt_loss``, exactly as
train.py does on every GPU at start-up. A few minutes on one core.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HARNESS = """
import os, threading, types
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
import torch
from numba import cuda
from numba.cuda.simulator import kernel as simulated_kernel, kernelapi
from nemo.collections.asr.parts.numba.rnnt_loss.utils.cuda_utils import gpu_rnnt
import tdt_loss

# CPU tensors stand in for device memory: the simulated kernels index numpy views of them (their
# writes land in the tensors), and torch's CUDA stream becomes a no-op one.
torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
cuda.external_stream = lambda pointer: types.SimpleNamespace(synchronize=lambda: None)
cuda.select_device = lambda index: None
gpu_rnnt.cuda.as_cuda_array = lambda t: t.detach().numpy() if isinstance(t, torch.Tensor) else t
launch = simulated_kernel.FakeCUDAKernel.__call__
simulated_kernel.FakeCUDAKernel.__call__ = lambda self, *args: launch(
    self, *[a.detach().numpy() if isinstance(a, torch.Tensor) else a for a in args]
)


def shfl_down_sync(mask, value, delta):
    # Every thread of the block posts its value, then reads the one `delta` lanes down its warp
    # (NeMo's reductions call it from every thread, so the block barrier is a warp barrier too).
    thread = threading.current_thread()
    posted = thread._manager.__dict__.setdefault("shuffle", {})
    dims = thread._manager._block_dim
    i = thread.threadIdx
    linear = i.x + dims[0] * (i.y + dims[1] * i.z)
    posted[linear] = value
    thread.syncthreads()
    got = posted.get(linear + delta, value) if linear % 32 + delta < 32 else value
    thread.syncthreads()
    return got


kernelapi.FakeCUDAModule.shfl_down_sync = staticmethod(shfl_down_sync)
torch.Tensor.is_cuda = property(lambda self: True)  # NeMo's autograd function takes its CUDA branch
tdt_loss.DeviceDispatchTDTLoss.uses_numba = lambda self, device: self.cuda_backend == "numba"
built = []
numba_loss = tdt_loss._numba_tdt_loss


def recorded(*args):
    wrapper = numba_loss(*args)
    built.append((type(wrapper._loss).__name__, args[1]["omega"]))
    return wrapper


tdt_loss._numba_tdt_loss = recorded
model_loss = tdt_loss.DeviceDispatchTDTLoss(8, [0, 1, 2, 3, 4], sigma=0.02, omega=0.1)
difference = tdt_loss.check_cuda_loss(model_loss, "cpu")
print(f"ran {built} largest difference {difference:.3g}")
"""


@pytest.mark.slow
def test_the_start_up_check_runs_nemos_tdt_and_rnnt_kernels_and_they_agree_with_tdt_loss():
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS], cwd=REPO, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ran [('TDTLossNumba', 0.0), ('TDTLossNumba', 1.0)]"), last
    assert float(last.rsplit(" ", 1)[1]) < 1e-3
