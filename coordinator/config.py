"""The coordinator's settings: `CoordinatorConfig` (and the chat-template bounds inside it) holds every
default once; `coordinator.main`'s flags read theirs from these dataclasses. Import-light (no grpc,
no zmq), because `splitserve --help` builds the flags from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coordinator.routing_policy import RoutingPolicy

if TYPE_CHECKING:
    from coordinator.tls import ServerTls

CLI_HTTP_PORT = 8000  # `splitserve coordinator --http-port`; in-process coordinators take a free port


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """The operator's bounds on chat-template rendering (coordinator flags)."""

    allow_request_template: bool = False  # --allow-request-chat-template
    render_timeout_s: float = 2.0  # --chat-template-timeout-ms
    max_rendered_chars: int = 1 << 20  # --max-rendered-chars
    render_threads: int = 2  # --chat-template-threads


@dataclass(slots=True)
class CoordinatorConfig:
    """Everything `splitserve coordinator` takes on its command line (see coordinator.main)."""

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    control_host: str = "127.0.0.1"
    control_port: int = 5555
    metrics_port: int = 9100
    http_port: int = 0  # the CLI's default is CLI_HTTP_PORT
    api_keys: tuple[str, ...] = ()  # entries: a key or `sha256:<hex>`; none = one anonymous principal
    admin_keys: tuple[str, ...] = ()  # none = AdminService disabled
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None  # None = AdminService on the main listener
    tls_cert: str | None = None  # PEM chain; with tls_key turns TLS on for the gRPC listeners
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mTLS: clients must present a certificate this CA signed
    insecure_grpc: bool = False  # allow plaintext on a non-loopback host (logged as a warning)
    health_host: str = "127.0.0.1"
    health_port: int | None = None  # a plaintext listener serving grpc.health.v1 only (for probes)
    templates: TemplateLimits = field(default_factory=TemplateLimits)
    max_queue: int = 256
    max_request_bytes: int = 1 << 20
    heartbeat_interval_ms: int = 500
    heartbeat_timeout_ms: int = 3000
    drain_timeout: float = 30.0
    control_key: str = ""  # this coordinator's .key_secret file (CURVE server key)
    control_authorized_keys: str = ""  # dir of worker public keys, each file named for its role
    insecure_control_plane: bool = False  # plaintext, unauthenticated control plane (logs a warning)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)  # --disaggregation and its limits

    def __post_init__(self) -> None:
        """ValueError naming the flag to pass when the TLS flags are inconsistent or a plaintext
        listener would bind a non-loopback host."""
        from coordinator.tls import check_plaintext_bind

        tls = self.tls()
        check_plaintext_bind(self.host, tls, self.insecure_grpc, "--insecure-grpc")
        if self.admin_port is not None:
            check_plaintext_bind(self.admin_host, tls, self.insecure_grpc, "--insecure-grpc")

    def tls(self) -> ServerTls | None:
        from coordinator.tls import server_tls

        return server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)
