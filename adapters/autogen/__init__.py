"""Adapter for autogen (arrives with the adapters issue)."""
