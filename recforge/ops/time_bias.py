"""The time-bias bucket rule, shared by the PyTorch references and the Triton kernels.

Its own module so that ``ops/triton`` imports it without importing the dispatcher
(``ops/hstu_attention.py`` imports the kernels, so the kernels must not import it back).
"""

from __future__ import annotations

import torch
from torch import Tensor

TIME_BUCKET_LOG_BASE = 0.301  # bucket width in log-seconds: each bucket spans x1.35 in time


def time_buckets(delta_seconds: Tensor, num_buckets: int) -> Tensor:
    """Map time differences (seconds) to log-spaced bucket indices in [0, num_buckets]."""
    d = delta_seconds.abs().clamp(min=1).to(torch.float32)
    return (torch.log(d) / TIME_BUCKET_LOG_BASE).floor().long().clamp(0, num_buckets)
