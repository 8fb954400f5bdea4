"""The speculative-decoding engine: plain PyTorch + transformers, no Django import.

A GPU host can run it, and its tests, on its own. See ``speculative.py`` for the
algorithm and ``models.py`` for loading and validation.
"""

from inference.engine.speculative import GenerationRequest, GenerationStats, SpeculativeConfig, generate

__all__ = ["GenerationRequest", "GenerationStats", "SpeculativeConfig", "generate"]
