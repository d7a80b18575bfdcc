"""What runs on the accelerator: paged attention and the KV scatter (torch reference)."""
