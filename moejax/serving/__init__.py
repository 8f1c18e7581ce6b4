"""Serving: text, stopping, continuous batching, the HTTP server and the load generator."""
