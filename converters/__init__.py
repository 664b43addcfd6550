"""Hugging Face checkpoint converters, one module per architecture family."""
