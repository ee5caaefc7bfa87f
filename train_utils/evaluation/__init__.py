"""Measuring a model: COCO ground truth and scoring, per-class metrics, pictures, detection
exports, speed, and the report of one evaluation. Never imports the training engine."""
