"""The fuse pass's rule families, one per module, each with its test beside it."""
