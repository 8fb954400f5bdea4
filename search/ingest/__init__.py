"""Turning uploaded files into normalised text and chunks (pure Python, no Django)."""
