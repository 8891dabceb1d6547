"""Tokenizer training/loading, tokenize-and-pack into sequence shards, and the packed torch Dataset."""
