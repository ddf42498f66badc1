"""picollama.server: an OpenAI-compatible and llama.cpp-style HTTP server.

``App`` holds the endpoints, ``Scheduler`` the engine thread and its slots (continuous
batching), ``picollama.server.http`` the HTTP transport; ``picollama-server`` starts them.
"""

from picollama.server.app import App, ServerConfig
from picollama.server.errors import APIError
from picollama.server.http import PicoHTTPServer, make_server
from picollama.server.scheduler import GenRequest, QueueFullError, Scheduler, engine_step

__all__ = [
    "App",
    "ServerConfig",
    "APIError",
    "PicoHTTPServer",
    "make_server",
    "GenRequest",
    "QueueFullError",
    "Scheduler",
    "engine_step",
]
