"""The GPU side of saves: pinned memory and side streams, the gather kernel, streaming, snapshots, async hand-off.

The write pipeline reaches it only through ``copier.DeviceCopier``, whose
base (CPU) implementation copies nothing; CUDA is touched only once a save
holds GPU tensors.
"""
