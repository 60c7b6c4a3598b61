"""The OpenAI Batch API of the gateway: HTTP routes, batch state (manifest + Redis lease), line conversion, the manager and one driver per batch."""
