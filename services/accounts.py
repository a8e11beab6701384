"""Who may say what on the bus: one NATS user per role, its subject permissions, and the
``nats-server`` configuration that enforces them.

Theory of operation. The event log is only as trustworthy as its writers, so each process gets
the subjects its job needs and nothing else (``ROLES``, the table below); everything not
allowed is denied by the server, which answers a forbidden publish with a permissions
violation and drops it. JetStream calls are subjects too (``$JS.API.<call>.<stream>``), so
"may read LB_WEIGHTS" is a list of API calls on the stream behind the bucket
(``KV_LB_WEIGHTS``) and "may write LB_WEIGHTS" is publishing on ``$KV.LB_WEIGHTS.>``.

======== ================================================ ===============================
role     publishes                                        reads
======== ================================================ ===============================
operator ``lb.admin.>``, ``lb.recorder.snapshot``         ``lb.out.>``; LB_WEIGHTS (get,
                                                          keys, watch); info of every stream;
                                                          ordered consumers of both streams
                                                          (``laswrr dashboard``)
scheduler ``lb.out.>``, ``lb.clock.>``, ``lb.admin.config`` consumes LB_EVENTS; reads LB_OUT
         (its ``--config``), ``$KV.LB_WEIGHTS.>``,        tail and both buckets; creates
         ``$KV.LB_CHECKPOINT.>``                          and updates every stream
proxy    ``lb.req.>``, ``lb.proxy.>``, ``lb.peer.>``      watches LB_WEIGHTS; ``lb.peer.>``
         (the channel between proxies, core NATS)         (the other proxies' views); ``lb.kv.>``
                                                          (the engines' cache changes); an ordered
                                                          consumer of LB_EVENTS (``lb.req.>``: the
                                                          latency estimate, shared)
collector ``lb.metrics.>``, ``lb.health.>``, ``lb.kv.>``  follows ``lb.admin.>`` in LB_EVENTS
         (``laswrr kv-events`` runs as a collector)       and watches LB_WEIGHTS
recorder replies to ``lb.recorder.snapshot`` requests     consumes LB_EVENTS and LB_OUT
         (and asks them: a reader in its container)
viewer   ``lb.recorder.snapshot`` (a copy of the log to    ``lb.peer.>``; ordered consumers of both streams;
         read), and JetStream reads                       LB_WEIGHTS (get, keys, watch);
                                                          info of every stream (``laswrr
                                                          dashboard``, ``laswrr nodes``)
======== ================================================ ===============================

Every role may read stream info and create a missing stream or bucket (``STREAM.CREATE`` fails
on an existing name with another configuration, so it changes nothing that exists); only the
scheduler may update them (``STREAM.UPDATE`` can shrink retention). Nobody may delete or purge
a stream. Replies travel on ``_INBOX.>``, which every role may subscribe to (the stock ``nats``
CLI uses that prefix); no role may publish there except the recorder's answers to requests it
received (``allow_responses``).

``server_config`` renders the ``authorization`` block with literal passwords (``laswrr up``,
random ones from ``new_passwords``) or with ``$VARIABLE`` references that nats-server resolves
from its environment (``compose.yaml``'s ``deploy/nats-server.conf``).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from laswrr.schemas import subjects as sj

KV_WEIGHTS = f"KV_{sj.WEIGHTS_BUCKET}"
KV_CHECKPOINT = f"KV_{sj.CHECKPOINT_BUCKET}"
STREAMS = (sj.EVENTS_STREAM, sj.OUT_STREAM, KV_WEIGHTS, KV_CHECKPOINT)
INBOX = "_INBOX.>"


def _stream_info(*streams: str) -> list[str]:
    return [f"$JS.API.STREAM.INFO.{s}" for s in streams]


def _stream_create(*streams: str) -> list[str]:
    return [f"$JS.API.STREAM.CREATE.{s}" for s in streams]


def _stream_get(*streams: str) -> list[str]:
    """Single messages by seq or last-per-subject (``kv get``, hole repair, the LB_OUT tail)."""
    return [x for s in streams for x in (f"$JS.API.STREAM.MSG.GET.{s}", f"$JS.API.DIRECT.GET.{s}",
                                          f"$JS.API.DIRECT.GET.{s}.>")]


def _consume(*streams: str) -> list[str]:
    """Create, read, ack and delete consumers of ``streams`` (pull, push, ordered, KV watch)."""
    return [x for s in streams for x in (
        f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.>",
        f"$JS.API.CONSUMER.INFO.{s}.>", f"$JS.API.CONSUMER.DELETE.{s}.>", f"$JS.API.CONSUMER.MSG.NEXT.{s}.>",
        f"$JS.ACK.{s}.>", f"$JS.FC.{s}.>")]


def _watch(*streams: str) -> list[str]:
    """Ordered (ephemeral) consumers of ``streams`` only: read, never delete anyone's consumer."""
    return [x for s in streams for x in (f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>",
                                          f"$JS.API.CONSUMER.INFO.{s}.>", f"$JS.FC.{s}.>")]


_SERVICE_SETUP = ["$JS.API.INFO", *_stream_info(*STREAMS), *_stream_create(sj.EVENTS_STREAM, sj.OUT_STREAM, KV_WEIGHTS)]


@dataclass(frozen=True)
class Role:
    name: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...] = (INBOX,)
    allow_responses: bool = False
    deny_publish: tuple[str, ...] = field(default=())  # spelled out for readers; the allow list already excludes them

    def permissions(self) -> dict[str, object]:
        publish: dict[str, object] = {"allow": list(self.publish)}
        if self.deny_publish:
            publish["deny"] = list(self.deny_publish)
        permissions: dict[str, object] = {"publish": publish, "subscribe": {"allow": list(self.subscribe)}}
        if self.allow_responses:
            permissions["allow_responses"] = True
        return permissions


ROLES: dict[str, Role] = {role.name: role for role in (
    Role("operator",
         publish=(sj.ADMIN_ALL, sj.RECORDER_SNAPSHOT, "$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
                  *_stream_info(*STREAMS), *_stream_get(KV_WEIGHTS), *_consume(KV_WEIGHTS),
                  *_watch(sj.EVENTS_STREAM, sj.OUT_STREAM)),
         subscribe=(sj.OUT_ALL, INBOX),
         deny_publish=("$KV.>", sj.REQ_ALL, sj.OUT_ALL, "$JS.API.STREAM.UPDATE.>", "$JS.API.STREAM.DELETE.>",
                       "$JS.API.STREAM.PURGE.>")),
    Role("scheduler",
         publish=(sj.OUT_ALL, sj.CLOCK_ALL, sj.ADMIN_CONFIG, f"$KV.{sj.WEIGHTS_BUCKET}.>",
                  f"$KV.{sj.CHECKPOINT_BUCKET}.>", *_SERVICE_SETUP, *_stream_create(KV_CHECKPOINT),
                  *[f"$JS.API.STREAM.UPDATE.{s}" for s in STREAMS], *_stream_get(*STREAMS),
                  *_consume(sj.EVENTS_STREAM))),
    Role("proxy", publish=(sj.REQ_ALL, sj.PROXY_ALL, sj.PEER_ALL, *_SERVICE_SETUP, *_stream_get(KV_WEIGHTS),
                           *_consume(KV_WEIGHTS), *_watch(sj.EVENTS_STREAM)),
         subscribe=(INBOX, sj.PEER_ALL, sj.KV_ALL)),
    Role("collector", publish=(sj.METRICS_ALL, sj.HEALTH_ALL, sj.KV_ALL, *_SERVICE_SETUP, *_consume(sj.EVENTS_STREAM),
                               *_stream_get(KV_WEIGHTS), *_consume(KV_WEIGHTS))),
    Role("recorder", publish=(sj.RECORDER_SNAPSHOT, *_SERVICE_SETUP, *_stream_get(sj.EVENTS_STREAM, sj.OUT_STREAM),
                              *_consume(sj.EVENTS_STREAM, sj.OUT_STREAM)),
         subscribe=(sj.RECORDER_SNAPSHOT, INBOX), allow_responses=True),
    # Read-only: what the dashboard, `laswrr nodes` and the analysts (report, replay, query, export
    # of the live log: a consistent copy asked of the recorder) read; no subject of the log to publish on.
    Role("viewer",
         publish=(sj.RECORDER_SNAPSHOT, "$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
                  *_stream_info(*STREAMS), *_stream_get(KV_WEIGHTS), *_consume(KV_WEIGHTS),
                  *_watch(sj.EVENTS_STREAM, sj.OUT_STREAM)),
         subscribe=(INBOX, sj.PEER_ALL),
         deny_publish=(*sj.EVENTS_SUBJECTS, *sj.OUT_SUBJECTS, sj.PEER_ALL, "$KV.>", "$JS.API.STREAM.CREATE.>",
                       "$JS.API.STREAM.UPDATE.>", "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>")),
)}


def new_passwords() -> dict[str, str]:
    """A random password per role (URL-safe: it goes into ``nats://role:password@host``)."""
    return {name: secrets.token_urlsafe(24) for name in ROLES}


def env_password_refs(prefix: str = "LASWRR_NATS_PASSWORD_") -> dict[str, str]:
    """``$LASWRR_NATS_PASSWORD_<ROLE>`` per role: nats-server reads them from its environment."""
    return {name: f"${prefix}{name.upper()}" for name in ROLES}


def authorization_block(passwords: Mapping[str, str]) -> str:
    """The ``authorization { users = [...] }`` block: literal passwords, or ``$VAR`` references."""
    lines = ["authorization {", "  users = ["]
    for name, role in ROLES.items():
        password = passwords[name]
        rendered = password if password.startswith("$") else json.dumps(password)
        permissions = json.dumps(role.permissions(), indent=2).replace("\n", "\n      ")
        lines.append(f"    {{user: {json.dumps(name)}, password: {rendered},")
        lines.append(f"     permissions: {permissions}}}")
    lines += ["  ]", "}"]
    return "\n".join(lines)


def server_config(passwords: Mapping[str, str], tls_cert: str | None = None, tls_key: str | None = None,
                  header: str = "") -> str:
    """A nats-server configuration file: the users of ``ROLES`` (and TLS when a certificate is given).
    Listen address, port and JetStream store stay on the command line."""
    parts = [header.rstrip()] if header else []
    parts.append(authorization_block(passwords))
    if tls_cert and tls_key:
        parts.append(f"tls {{\n  cert_file: {json.dumps(tls_cert)}\n  key_file: {json.dumps(tls_key)}\n}}")
    return "\n".join(parts) + "\n"


COMPOSE_HEADER = """\
# nats-server configuration of compose.yaml: one user per laswrr role, with the permissions of
# services/accounts.py. Generated: `python -c "from laswrr.services import accounts;
# print(accounts.compose_config(), end='')" > deploy/nats-server.conf` (a test checks it matches).
# The passwords come from nats-server's environment: LASWRR_NATS_PASSWORD_<ROLE>."""


def compose_config() -> str:
    """``deploy/nats-server.conf``: the users of ``ROLES``, passwords from environment variables."""
    return server_config(env_password_refs(), header=COMPOSE_HEADER)


def role_url(role: str, password: str, host: str, port: int, scheme: str = "nats") -> str:
    return f"{scheme}://{role}:{password}@{host}:{port}"


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only (0600; the directory 0700)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as sink:
        sink.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT
    return path


def write_secrets(secrets_dir: Path, urls: Mapping[str, str]) -> dict[str, Path]:
    """``<secrets_dir>/<role>.env``, one line ``NATS_URL=...`` each, mode 0600."""
    return {role: write_private(secrets_dir / f"{role}.env", f"NATS_URL={url}\n") for role, url in urls.items()}
