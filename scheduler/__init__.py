"""The scheduler process: block manager, waiting/running queues and the continuous-batching step loop. Imports no torch."""

# This folder is linked into the package (sluiceway/scheduler): one file, one module name.
if __name__ != "sluiceway.scheduler":
    raise ImportError(f"import sluiceway.scheduler, not {__name__} (README, Layout)")
