"""distributed/ddp.py: what DDP copies from rank 0 at each forward, in a real 2-process group."""

from __future__ import annotations

import sys

import pytest
from conftest import rank_envs, run_fresh_ranks

# Each rank: a gloo group, a model with BatchNorm wrapped as training wraps it, without
# SyncBatchNorm and as with it (which DDP accepts on CUDA modules only: here its choice is
# forced and the conversion left out); whether DDP will copy rank 0's buffers at a forward.
_WRAP = """
import argparse
import torch
from torch import nn
from train_utils.distributed import ddp, process_group
args = argparse.Namespace(device="cpu", local_rank=-1)
info = process_group.init_distributed_mode(args, timeout_s=60)
plain = ddp.wrap_for_training(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), info)
ddp.use_sync_batchnorm = lambda *a: (True, "")
nn.SyncBatchNorm.convert_sync_batchnorm = staticmethod(lambda module: module)
synced = ddp.wrap_for_training(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), info)
print(plain.will_sync_module_buffers(), synced.will_sync_module_buffers())
process_group.cleanup()
"""


@pytest.mark.slow
def test_ddp_copies_rank_0s_buffers_at_each_forward_unless_syncbatchnorm_keeps_them_equal():
    for code, out, err in run_fresh_ranks([sys.executable, "-c", _WRAP], rank_envs()):
        assert code == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "True False", out
