"""Reference outputs of a Darknet cfg + .weights computed by OpenCV's Darknet importer.

Run by tests/models/test_darknet_opencv.py under the separate ``.venv-cv4`` environment (numpy and
opencv-python-headless 4.x only: OpenCV 5 dropped ``readNetFromDarknet``), so it must not import
anything from this repository::

    .venv-cv4/bin/python tests/opencv_darknet_ref.py CFG WEIGHTS INPUT.npy OUT.npz NAME [NAME ...]

``INPUT.npy`` is a float32 (1, 3, H, W) blob in [0, 1]; each NAME is an OpenCV layer name
(``conv_105`` is the convolution of Darknet layer 105, before its activation, which OpenCV keeps
as a layer of its own such as ``logistic_106``). ``OUT.npz`` holds one array per name.
"""

from __future__ import annotations

import sys

import cv2
import numpy as np


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    cfg, weights, input_path, out_path, *names = argv
    net = cv2.dnn.readNetFromDarknet(cfg, weights)
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
    # Winograd 3x3 convolutions trade about 1e-6 relative accuracy per layer for speed.
    net.enableWinograd(False)
    known = set(net.getLayerNames())
    missing = [n for n in names if n not in known]
    if missing:
        print(f"layers not in the OpenCV network: {missing}", file=sys.stderr)
        return 2
    net.setInput(np.load(input_path))
    outputs = net.forward(names)
    np.savez(out_path, **{n: np.asarray(o, dtype=np.float32) for n, o in zip(names, outputs)})
    print(f"OpenCV {cv2.__version__}: {len(names)} outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
