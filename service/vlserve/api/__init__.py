"""The HTTP layer, laid out as vLLM's and llama-cpp-python's servers are: an app factory with a
lifespan (`vlserve.api.app`), dependencies, one error shape, and one router per endpoint group.

Knows nothing of torch: it turns requests into the engine's inputs (messages with decoded images,
sampling parameters) and the engine's events into OpenAI-shaped responses and server-sent events.

  errors        APIError, the error shape and the exception handlers
  middleware    the body limit and the request counter
  dependencies  settings, engine, ready submitter, API key
  submission    the one request path shared by chat and ask
  routes/       health (/healthz, /readyz, /metrics), openai (/v1/models, /v1/chat/completions), ask (/v1/ask)
"""
