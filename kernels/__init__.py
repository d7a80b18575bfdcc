"""What runs on the accelerator: paged attention and the KV scatter (torch reference)."""

# This folder is linked into the package (sluiceway/kernels): one file, one module name.
if __name__ != "sluiceway.kernels":
    raise ImportError(f"import sluiceway.kernels, not {__name__} (README, Layout)")
