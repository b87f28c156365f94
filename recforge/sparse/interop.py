"""TorchRec interop: a ``KeyedJaggedTensor`` in, ``JaggedIds`` per feature out.

TorchRec is an optional extra (``pip install recforge[torchrec]``); nothing here imports
it: a KJT is read through its public methods (``keys()``, ``to_dict()``).
"""

from __future__ import annotations

from recforge.sparse.collection import JaggedIds


def from_keyed_jagged(kjt) -> dict[str, JaggedIds]:
    """Features of a TorchRec ``KeyedJaggedTensor`` (weights, if any, are not used)."""
    if not (hasattr(kjt, "keys") and hasattr(kjt, "to_dict")):
        raise ValueError(
            f"expected a dict of JaggedIds or a torchrec KeyedJaggedTensor, got {type(kjt).__name__}"
        )
    return {name: JaggedIds(jt.values(), jt.offsets()) for name, jt in kjt.to_dict().items()}
