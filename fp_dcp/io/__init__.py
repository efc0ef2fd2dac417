"""The I/O layer: moving byte ranges between memory and files as fast as the disk allows.

Engines (io_uring or a thread pool), files opened with or without O_DIRECT,
page-aligned buffers, the extents a transfer is cut into and the window that
keeps several in flight, the dealing rule that evens out bytes over bins,
progress reporting. Nothing here knows about torch or DCP (an import
contract in ``make lint`` keeps it so).
"""
