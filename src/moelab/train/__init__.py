"""Training: config, schedule, checkpoints, evaluation, the training loop."""
