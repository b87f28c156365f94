"""recforge: train, evaluate and serve generative recommenders."""

__version__ = "0.1.0"
