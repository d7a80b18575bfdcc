"""The worker process: model weights, KV pool, one forward pass and sampling per step."""

# This folder is linked into the package (sluiceway/worker): one file, one module name.
if __name__ != "sluiceway.worker":
    raise ImportError(f"import sluiceway.worker, not {__name__} (README, Layout)")
