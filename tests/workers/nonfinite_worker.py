"""One rank of a 2-process gloo group (torchrun's variables) in which rank 1's second logged loss
is NaN: the engine's finiteness check must stop both ranks at the same step. Writes
``OUT/rank<r>.json`` with what each rank raised.

Usage: python -m tests.workers.nonfinite_worker OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from train_utils.distributed import process_group
from train_utils.engine import NONFINITE_ADVICE, NonFiniteLossError, _check_finite


def main(argv: list[str] | None = None) -> None:
    out = Path((sys.argv[1:] if argv is None else argv)[0])
    info = process_group.init_distributed_mode(None, timeout_s=60)
    r = info.rank
    # Three logged iterations; rank 1's second loss is NaN.
    flags = [torch.tensor(True), torch.tensor(r != 1), torch.tensor(True)]
    paths = [[f"r{r}_a.jpg"], [f"r{r}_b.jpg", f"r{r}_c.jpg"], [f"r{r}_d.jpg"]]
    res = {"clean": None, "error": None}
    _check_finite(
        [torch.tensor(True)], [["ok.jpg"]], "epoch 3", NONFINITE_ADVICE
    )  # nobody bad: nobody raises
    res["clean"] = "passed"
    try:
        _check_finite(flags, paths, "epoch 3", NONFINITE_ADVICE)
    except NonFiniteLossError as e:
        res["error"] = str(e)
    process_group.cleanup()
    (out / f"rank{r}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
