"""Stores: in-memory, SQL (SQLite; PostgreSQL-ready), and the HTTP client."""
