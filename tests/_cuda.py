"""CUDA-graph helpers shared by GPU tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture_without_syncs(
    step: Callable[[], Any], before: Callable[[], None] | None = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, its outputs): ``step`` run once on a side stream (kernels compiled, lazy state built outside the
    capture), ``before()`` if given, then captured with ``torch.cuda.set_sync_debug_mode("error")`` so that a host
    sync inside the step fails the test, as it would fail ``train.cuda_graphs``' capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: kernels compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    if before is not None:
        before()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return graph, out
