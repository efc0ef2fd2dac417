"""Child processes that start at once: forked from a server that imported torch once.

A new interpreter spends seconds importing torch (3-4 s on a loaded 2-core
machine), and fp-dcp a fifth of a second more; a test or a benchmark that
starts many processes (ranks, crash trials' savers and loaders) would spend
most of its time there. ``context()`` is multiprocessing's forkserver with
torch, torch.distributed, torch.distributed.checkpoint and fp-dcp imported
in the server: each child is a new process forked from it, shares nothing
with its siblings, and dies, exits and is killed (SIGKILL, SIGTERM) as a
process of its own does.

The server is one per process, started by the first child, with the
environment and ``sys.path`` of that moment. A child that is to run with
its parent's environment as it is when the child starts gets it with
``environment()`` and takes it with ``inherit()`` (the rank launcher does),
stdout and stderr too (``Inherited`` hands over a file descriptor);
``inherit`` also redoes the one thing fp-dcp reads from the environment at
import, whether it is DCP's default storage (``FP_DCP_DEFAULT_STORAGE``).
``fresh=True`` starts new interpreters instead, for what happens at
interpreter start-up (``.pth`` files).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from multiprocessing import reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

from ..integrations import default_storage

__all__ = ["PRELOAD", "context", "Inherited", "environment", "inherit", "free_port"]

# What the server imports once, before any child: the costly part of starting one.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "fp_dcp")


def context(fresh: bool = False) -> ForkServerContext | SpawnContext:
    """multiprocessing's forkserver context, its server preloaded with torch; ``fresh``: spawn (new interpreters)."""
    if fresh:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class Inherited:
    """One of this process's file descriptors, handed to a child as it starts (the child gets a duplicate).

    A forked child's stdout and stderr are the server's, never its parent's: pytest captures what a rank prints
    (a hung rank's stacks) only where the child writes to its parent's. ``inherit`` puts them in place."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return int(duplicate.detach())


Handed = tuple[dict[str, str], "Inherited | int", "Inherited | int"]


def environment() -> Handed:
    """This process's environment, stdout and stderr, to be handed to a child (``inherit`` takes them there)."""
    return dict(os.environ), Inherited(1), Inherited(2)


def inherit(handed: Handed) -> None:
    """In the child: the environment, stdout and stderr of ``environment()``, in place of the server's; fp-dcp DCP's
    default storage as the environment says (the server imported it with its own)."""
    environ, stdout, stderr = handed
    os.environ.clear()
    os.environ.update(environ)
    for fd, target in ((stdout, 1), (stderr, 2)):
        assert isinstance(fd, int)  # an Inherited arrives as the descriptor it duplicated
        os.dup2(fd, target)
        os.close(fd)
    default_storage.uninstall()
    default_storage.install_from_environment()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous's, as ``torchrun`` makes one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
