"""Ask the built Darknet (the harness of build.py) what it computes, from Python tests.

Every function takes the harness path (the ``darknet_harness`` fixture) and works in a folder
the test owns; arrays go in and out as float32 files.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

HARNESS_TIMEOUT_S = 300
NET_SECTIONS = ("[net]", "[network]")


def rewrite_cfg(
    src: Path,
    dst: Path,
    size: int | None = None,
    yolo: Mapping[str, object] | None = None,
    net: Mapping[str, object] | None = None,
) -> Path:
    """``src`` written to ``dst`` with ``width=height=size`` and the ``net`` keys in ``[net]``
    and the ``yolo`` keys in every ``[yolo]`` (replacing the same keys there: Darknet would read
    the first of a repeated key, this repository refuses repeats)."""
    net = dict(net or {})
    if size is not None:
        net.update(width=size, height=size)
    yolo = dict(yolo or {})
    out: list[str] = []
    section = None
    for line in src.read_text().splitlines():
        bare = line.split("#")[0].strip()
        if bare.startswith("["):
            section = bare
            out.append(line)
            keys = net if section in NET_SECTIONS else yolo if section == "[yolo]" else {}
            out += [f"{k}={v}" for k, v in keys.items()]
            continue
        key = bare.split("=")[0].strip()
        if (section in NET_SECTIONS and key in net) or (section == "[yolo]" and key in yolo):
            continue
        out.append(line)
    dst.write_text("\n".join(out) + "\n")
    return dst


def write_truths(path: Path, rows: Sequence[Sequence[float]]) -> Path:
    """Lines ``image x y w h class``."""
    path.write_text("".join(" ".join(repr(v) for v in r) + "\n" for r in rows))
    return path


def run_harness(harness: Path, args: Sequence[object], cwd: Path) -> str:
    """The harness's stdout for ``args``, run in ``cwd`` (Darknet appends bad_label.list and
    bad.list to its working folder when it meets a bad label)."""
    proc = subprocess.run(
        [str(harness), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=HARNESS_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"harness {args[0]} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def yolo_deltas(
    harness: Path,
    cfg: Path,
    rows: Sequence[Sequence[float]],
    inputs: Mapping[int, np.ndarray],
    work: Path,
) -> dict[int, tuple[np.ndarray, float]]:
    """Darknet's ``(l.delta, *l.cost)`` of each ``[yolo]`` layer in ``inputs`` (layer index ->
    float32 (batch, c, h, w) input), with truths ``rows`` (image, x, y, w, h, class)."""
    batch = next(iter(inputs.values())).shape[0]
    truths = write_truths(work / "truths.txt", rows)
    args: list[str | Path] = ["yolo", cfg, str(batch), truths]
    for layer, x in inputs.items():
        stem = work / f"layer{layer}"
        np.ascontiguousarray(x, dtype="<f4").tofile(f"{stem}.in.f32")
        args += [str(layer), f"{stem}.in.f32", f"{stem}.delta.f32", f"{stem}.cost.txt"]
    run_harness(harness, args, work)
    out = {}
    for layer, x in inputs.items():
        stem = work / f"layer{layer}"
        delta = np.fromfile(f"{stem}.delta.f32", dtype="<f4").reshape(x.shape)
        out[layer] = (delta, float(Path(f"{stem}.cost.txt").read_text()))
    return out


def learning_rates(harness: Path, cfg: Path, iterations: int, seed: int = 1) -> np.ndarray:
    """Darknet's ``get_current_rate`` at ``seen = k * batch`` for k < ``iterations``
    (``srand(seed)`` first), as float32."""
    text = run_harness(harness, ["lr", cfg, str(iterations), str(seed)], cfg.parent)
    return np.array([float(v) for v in text.split()], dtype=np.float32)


def train_iterations(
    harness: Path,
    cfg: Path,
    weights: Path,
    images: np.ndarray,
    rows: Sequence[Sequence[float]],
    iterations: int,
    out: Path,
) -> Path:
    """Darknet's weights after ``iterations`` calls of ``train_network`` on ``images`` (float32
    (batch, c, h, w), the cfg's whole batch) from ``weights``."""
    x = out.with_suffix(".in.f32")
    np.ascontiguousarray(images, dtype="<f4").tofile(x)
    truths = write_truths(out.with_suffix(".truths.txt"), rows)
    run_harness(harness, ["update", cfg, weights, x, truths, str(iterations), out], out.parent)
    return out
