"""Training recipes, losses, metrics and checkpoints."""
