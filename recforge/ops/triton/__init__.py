"""Triton kernels for the attention ops (HSTU and softmax) on jagged sequences.

Nothing here is imported by ``recforge.ops`` at import time: ``recforge.ops.dispatch``
checks that Triton is installed and imports the kernel modules on first use, so that
``TRITON_INTERPRET=1`` (read by Triton when a kernel is defined) can still be set by a
test before the kernels are built.
"""
