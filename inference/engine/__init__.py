"""The speculative-decoding engine, the exact reference the served engines are held against:
plain PyTorch + transformers, no Django import. A GPU host can run it, and its tests, on its own.
See ``speculative.py`` for the algorithm and ``models.py`` for loading and validation.

Import its modules by name (``inference.engine.speculative``): this package's ``__init__`` loads
nothing, so that importing ``inference.engine.server``'s neighbours never pulls torch in by
accident, and the serving path imports none of it (an import-linter contract)."""
