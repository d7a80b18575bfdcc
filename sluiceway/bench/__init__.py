"""`sluiceway bench`: serving benchmarks modelled on `vllm bench serve`.

- :mod:`.serve`: one workload against a running server (`bench serve`).
- :mod:`.compare`: the same workload against a server started per
  configuration, and optionally `transformers` batched `generate`
  (`bench compare`).
"""
