"""Adapter for openai_agents (arrives with the adapters issue)."""
