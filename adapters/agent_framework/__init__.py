"""Adapter for agent_framework (arrives with the adapters issue)."""
