"""prefill package."""
