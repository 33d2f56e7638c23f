"""The engine's errors: each has a machine-readable `code`; the HTTP layer maps each kind to a status."""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's errors; `code` is machine-readable, the message is for people."""

    code = "engine_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequest(EngineError):
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class NotReady(EngineError):
    code = "not_ready"


class Overloaded(EngineError):
    code = "queue_full"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class MemoryPressure(Overloaded):
    code = "memory_pressure"


class RequestTimeout(EngineError):
    code = "timeout"


class EngineFailure(EngineError):
    code = "engine_failure"


class ModelDirectoryError(EngineError):
    code = "model_directory"
