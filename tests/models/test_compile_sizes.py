"""``--compile`` with multi-scale training: Darknet's forward is compiled once for a fixed size
and once more with symbolic sizes, then serves every later size without recompiling.

The asymmetric max-pool padding of yolov3-tiny (``size=2 stride=1``, and ``size=2 stride=2``
with Darknet's default odd padding) computes its padding from the input size in Python; dynamo
traces that arithmetic on symbolic sizes (``int()`` of a size stays symbolic), so it adds only
guards that every multiple of 32 passes. Counted with dynamo's own counters on a tiny model; the
``eager`` backend keeps it to dynamo's tracing (no code generation).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import REPO_ROOT
from torch._dynamo.utils import counters

from models.darknet import Darknet

TINY_CFG = REPO_ROOT / "cfg" / "yolov3-tiny.cfg"
# Multiples of 32 large enough that no CPU convolution-backend threshold (a guard on a layer's
# element count) falls between them; multi-scale picks among such sizes.
SIZES = (320, 352, 384)
# The first size compiles for fixed shapes; the second marks the sizes dynamic and compiles
# once more; every later size must reuse that graph.
MAX_GRAPHS = 2


def graphs_for_sizes(device: str) -> int:
    """Graphs dynamo compiled for one training-mode forward at each of ``SIZES``."""
    torch._dynamo.reset()
    counters.clear()
    model = Darknet(TINY_CFG, img_size=SIZES[0]).to(device).train()
    compiled = torch.compile(model, backend="eager")
    for side in SIZES:
        compiled(torch.rand(1, 3, side, side, device=device))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def test_multi_scale_sizes_reuse_one_dynamic_graph() -> None:
    assert graphs_for_sizes("cpu") <= MAX_GRAPHS


@pytest.mark.cuda
def test_multi_scale_sizes_reuse_one_dynamic_graph_on_cuda() -> None:
    assert graphs_for_sizes("cuda") <= MAX_GRAPHS
