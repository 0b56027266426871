"""Ways in from outside Python: the OpenAI-compatible server (openai/) and the console script (cli)."""
