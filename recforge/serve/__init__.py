"""Serving: prefix-cached ranking engine, per-user KV-cache pool, batching scheduler, HTTP server, export.

Example:
    >>> from recforge.serve import RankEngine
    >>> engine = RankEngine.from_run("runs/ranking-taobao-hstu")
    >>> engine.rank("u1", {"items": [5, 9], "timestamps": [100, 200]}, candidates=[3, 7], timestamp=300).scores
"""

from recforge.serve.engine import EngineConfig, PrefixState, RankEngine, RankResult
from recforge.serve.layout import History, RequestError

__all__ = ["EngineConfig", "History", "PrefixState", "RankEngine", "RankResult", "RequestError"]
