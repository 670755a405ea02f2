"""The OpenAI-compatible HTTP door of the coordinator (see docs/http.md).

errors    the one table from the gRPC statuses admission and the dispatcher raise to HTTP codes
schema    OpenAI JSON bodies -> the same ChatRequest / GenerateRequest messages gRPC clients send
render    stream steps -> OpenAI JSON objects and server-sent-event chunks
routes    the Starlette app: /v1/chat/completions, /v1/completions, /v1/models, /health
server    uvicorn on the coordinator's own event loop, beside the gRPC server
"""
