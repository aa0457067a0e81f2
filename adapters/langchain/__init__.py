"""Adapter for langchain (arrives with the adapters issue)."""
