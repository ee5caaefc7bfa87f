"""The Darknet model built from a cfg file, its layers, loss and weight formats.

The names below are importable from ``models`` directly but are loaded lazily, so that
``import models.loss`` (or any other submodule) does not pull in the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Darknet": "models.darknet",
    "YOLOLayer": "models.layers",
    "FeatureConcat": "models.layers",
    "WeightedFeatureFusion": "models.layers",
    "load_darknet_weights": "models.weights",
    "save_weights": "models.weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
