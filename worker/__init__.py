"""The worker process: model weights, KV pool, one forward pass and sampling per step."""
