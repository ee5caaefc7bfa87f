"""Training side: configuration, the training loop, evaluation, checkpoints, distributed."""
