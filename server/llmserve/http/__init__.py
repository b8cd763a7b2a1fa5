"""The push-mode HTTP front end (FastAPI): native protocol and OpenAI API, forwarded to Triton over gRPC."""
