"""``train_multi_GPU.py ARGS`` as one rank of a gloo group (torchrun's variables), on a disk
that fills up after rank 0's first checkpoint: rank 0's second ``torch.save`` writes a few
bytes and fails as torch does on a full disk. Every rank must stop with the same one-line
error and exit status 2, none waiting for rank 0 at the epoch's end.

Usage: python -m tests.workers.full_disk_train TRAIN_ARGS...
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import train_multi_GPU


def main() -> int:
    real_save, calls = torch.save, []

    def save_then_fill_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            real_save(obj, f, *args, **kwargs)
            return
        f.write(b"PK\x03\x04partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    torch.save = save_then_fill_disk  # only rank 0 saves checkpoints
    return train_multi_GPU.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
