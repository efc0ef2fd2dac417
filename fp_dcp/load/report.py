"""What a check of a whole checkpoint reports: ``VerifyReport`` (``verify_checkpoint``'s, and the base of the
safetensors directory's)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VerifyReport"]


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` found.

    Attributes:
        path: the checkpoint directory.
        ok: no problem found.
        problems: one line per problem, naming the file and, where the
            problem is in an item's bytes, the item (its fqn and chunk).
        items: items the metadata lists (all examined).
        bytes: item bytes read and checked against their CRC-32C.
        files: data files the metadata lists.
        checksums: False for a torch ``FileSystemWriter`` checkpoint, which
            stores none: then only file presence and sizes were checked.
        partial: for a node's copy of a tiered step (``.node``) that lacks
            data files, what it holds ("" otherwise): the files there are
            checked, the absent ones are on other nodes' roots or the
            durable root, and their absence is no problem.
    """

    path: str
    ok: bool
    problems: list[str]
    items: int
    bytes: int
    files: int
    checksums: bool = True
    partial: str = ""
