"""Training side: configuration, the training loop, evaluation, checkpoints and distributed helpers."""
