"""The router process: public gRPC API, tokenizer, chat template, detokenization, stop strings."""

# This folder is linked into the package (sluiceway/router): one file, one module name.
if __name__ != "sluiceway.router":
    raise ImportError(f"import sluiceway.router, not {__name__} (README, Layout)")
