"""The browser UI: search, streamed answers with citations, documents and recent questions (docs/ui.md)."""
