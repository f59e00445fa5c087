"""The gateway: OpenAI-compatible HTTP in front of the Redis bus (aiohttp, no torch)."""
