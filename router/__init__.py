"""The router process: public gRPC API, tokenizer, chat template, detokenization, stop strings."""
