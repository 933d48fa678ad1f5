"""flash-models: a transformer model zoo on its own kernels."""
