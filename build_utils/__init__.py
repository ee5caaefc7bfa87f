"""Data-side utilities: cfg parsing, datasets, augmentation, box math and samplers.

This package imports no other project package (see ``tests/project/test_layout.py``).
"""
