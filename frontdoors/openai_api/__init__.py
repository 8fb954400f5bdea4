"""The OpenAI-compatible API under ``/v1/``: models, chat completions over the answer
pipeline, embeddings; bearer client keys (``rk_...``). See docs/openai.md."""
