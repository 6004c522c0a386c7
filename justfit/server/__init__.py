"""`justfit serve`: OpenAI- and Ollama-compatible HTTP endpoints over one engine."""

from justfit.server.app import Server, ServerConfig, run

__all__ = ["Server", "ServerConfig", "run"]
