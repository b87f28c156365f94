"""Dynamic embeddings: raw int64 IDs -> rows created on admission, evicted by policy, updated sparsely.

Pieces (one process; a shard on a rank is simply a table):

- ``DynamicEmbedding`` (table.py): ID index + rows + policies + sparse optimizer + tiers.
- ``IdHashTable`` (hash_table.py): vectorised open addressing in torch tensors (the CPU index);
  ``SortedIdIndex`` (sorted_index.py): sorted key array, searchsorted + merge (the CUDA index).
- kernels.py: optional Triton kernels of the CUDA path (fused lazy Adam, host<->cache row swaps);
  lookup.py: dedup, index lookup and counters queued before a lookup's one host synchronisation,
  the duplicate-summing backward and the prefetch's row bitmap (its Triton kernels: lookup_kernels.py).
- ``AdmissionConfig`` / ``EvictionConfig`` (policies.py), ``SparseOptimConfig`` /
  ``SparseOptimizer`` (optim.py), ``RowStore`` / ``TieredStore`` (storage.py).
- ``EmbeddingCollection`` (collection.py): features, merged tables, jagged/pooled lookups.
- checkpoint.py: sharded safetensors checkpoints, delta and fp16/int8 exports, warm start.
- Across ranks: ``ShardedDynamicEmbedding`` (sharded.py: one shard per rank, IDs and rows moved by
  all-to-all; the ID exchange in distribution.py, a lookup staged a step ahead in staging.py, owners and
  handles in routing.py), ``plan_sharding`` / ``ShardingPlan`` (planner.py: row-wise or table-wise per table),
  sharded_checkpoint.py: a file per rank, loadable on another world size, exportable to one process.

Example:
    >>> table = DynamicEmbedding(TableConfig(name="item", dim=64, optimizer=SparseOptimConfig(kind="adam", lr=1e-3)))
    >>> sparse_opt = SparseOptimizer([table]); dense_opt = torch.optim.AdamW(model.parameters())
    >>> loss = model(table(raw_item_ids)).mean(); loss.backward()
    >>> dense_opt.step(); sparse_opt.step(); dense_opt.zero_grad()
"""

from recforge.sparse.checkpoint import (
    export_rows,
    load_export,
    load_sparse_checkpoint,
    save_sparse_checkpoint,
    to_dense,
    to_embedding,
    warm_start,
)
from recforge.sparse.collection import EmbeddingCollection, FeatureConfig, JaggedIds
from recforge.sparse.hash_table import IdHashTable
from recforge.sparse.optim import SparseOptimConfig, SparseOptimizer
from recforge.sparse.planner import ShardingPlan, plan_sharding, shard_collection
from recforge.sparse.policies import AdmissionConfig, EvictionConfig
from recforge.sparse.sharded import ShardedDynamicEmbedding, sharded_tables
from recforge.sparse.sharded_checkpoint import export_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from recforge.sparse.sorted_index import SortedIdIndex
from recforge.sparse.table import DynamicEmbedding
from recforge.sparse.table_config import TableConfig

__all__ = [
    "AdmissionConfig", "DynamicEmbedding", "EmbeddingCollection", "EvictionConfig", "FeatureConfig", "IdHashTable",
    "JaggedIds", "ShardedDynamicEmbedding", "ShardingPlan", "SortedIdIndex", "SparseOptimConfig", "SparseOptimizer",
    "TableConfig", "export_rows", "export_sharded_checkpoint", "load_export", "load_sharded_checkpoint",
    "load_sparse_checkpoint", "plan_sharding", "save_sharded_checkpoint", "save_sparse_checkpoint", "shard_collection",
    "sharded_tables", "to_dense", "to_embedding", "warm_start",
]  # fmt: skip
