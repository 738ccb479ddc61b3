"""The request: its types, the buckets it runs in, and the validation that resolves its parameters."""
