"""The OpenAI-compatible HTTP API: wire schemas, routes, errors and SSE."""
