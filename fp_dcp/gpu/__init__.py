"""The GPU side of saves and loads: pinned memory and side streams, the gather and CRC-32C kernels, streaming,
snapshots, async hand-off, loads into GPU tensors.

The write pipeline reaches it only through ``copier.DeviceCopier``, whose
base (CPU) implementation copies nothing; CUDA is touched only once a save
holds GPU tensors.
"""
