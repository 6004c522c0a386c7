"""`justfit serve`: OpenAI- (/v1), Ollama- (/api) and Anthropic-compatible
(/v1/messages) HTTP endpoints over one engine, and its status page (/)."""

from justfit.server.app import Server, ServerConfig, run

__all__ = ["Server", "ServerConfig", "run"]
