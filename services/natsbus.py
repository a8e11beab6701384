"""The bus contract shared by every service: connections and auth, streams, buckets, publishing.

One module owns stream/bucket setup (style.md): LB_EVENTS holds every input subject
(``lb.>`` except ``lb.out.>``), LB_OUT every output, KV bucket LB_WEIGHTS the latest snapshot of
each pool, KV bucket LB_CHECKPOINT the scheduler's checkpoint. Setup is idempotent (create what
is missing; an existing stream's limits are the operator's and only warned about) so every
service may call it at start-up. On a NATS cluster (an operator's own, or
``nats_server.NatsCluster``: several embedded servers joined by routes) streams and buckets are created with
``StreamLimits.replicas`` copies, and ``--nats-url`` may list every server, comma-separated:
``connect`` hands them all to nats-py, which fails over between them. The de-duplication window
makes ``Nats-Msg-Id`` (``MSG_ID``) publishes safe to repeat: two scheduler replicas yield one tick
per period and one copy of each output. ``connect`` is the only way any command reaches the bus.
Running nats-server processes (``EmbeddedNats``, ``NatsCluster``) is services/nats_server.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from laswrr.schemas import subjects as sj

log = logging.getLogger("laswrr.natsbus")

MSG_ID = "Nats-Msg-Id"  # JetStream de-duplicates publishes that repeat this header within the window


@dataclass(frozen=True)
class StreamLimits:
    max_age_s: float = 7 * 24 * 3600.0
    max_bytes: int = 8 << 30
    max_msgs: int = -1
    duplicate_window_s: float = 120.0
    storage: StorageType = StorageType.FILE
    replicas: int = 1  # copies of each stream and bucket on a cluster (JetStream allows 1..5)


MAX_REPLICAS = 5


def stream_configs(limits: StreamLimits) -> list[StreamConfig]:
    common = dict(retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, storage=limits.storage,
                  max_age=limits.max_age_s, max_bytes=limits.max_bytes, max_msgs=limits.max_msgs,
                  duplicate_window=limits.duplicate_window_s, num_replicas=limits.replicas)
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
    await _ensure_bucket(js, KeyValueConfig(bucket=sj.WEIGHTS_BUCKET, history=1, storage=limits.storage,
                                            replicas=limits.replicas))


async def _ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """The bucket ``config`` names, created if missing; an existing one's replicas only warned about."""
    try:
        kv = await js.key_value(config.bucket)
    except (NotFoundError, BadRequestError):
        with contextlib.suppress(BadRequestError):  # a replica created it meanwhile
            await js.create_key_value(config)
        return await js.key_value(config.bucket)
    have = (await js.stream_info(f"KV_{config.bucket}")).config.num_replicas
    if have is not None and have != config.replicas:
        log.warning("bucket %s has num_replicas = %s where this service would create %s: left as it is",
                    config.bucket, have, config.replicas)
    return kv


async def ensure_checkpoint_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """The scheduler's KV LB_CHECKPOINT (created on first use: only the scheduler writes it)."""
    return await _ensure_bucket(js, KeyValueConfig(bucket=sj.CHECKPOINT_BUCKET, history=1, storage=StorageType.FILE,
                                                   max_value_size=-1, replicas=replicas))


async def wait_jetstream(nc: Client, timeout_s: float = 30.0) -> float:
    """Block until JetStream answers API calls (on a cluster: its meta leader is elected, which
    takes a few seconds after the servers start); the seconds it took. TimeoutError after
    ``timeout_s``."""
    started = time.monotonic()
    last: object = None
    while time.monotonic() - started < timeout_s:
        try:
            reply = json.loads((await nc.request("$JS.API.INFO", b"", timeout=1.0)).data)
            if "error" not in reply:
                return time.monotonic() - started
            last = reply["error"].get("description")
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ValueError) as exc:
            last = exc or type(exc).__name__
        await asyncio.sleep(0.1)
    raise TimeoutError(f"JetStream not available after {timeout_s:g} s ({last})")


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


def split_urls(url: str) -> list[str]:
    """A ``--nats-url`` value: one URL, or several comma-separated (the servers of a cluster)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def server_pool(url: str) -> tuple[list[str], dict[str, str]]:
    """``url``'s servers for nats-py's pool, and the credentials they share as connect options.

    nats-py sends a URL's ``user:password@`` (or ``token@``) only to that URL's server, and the
    servers a cluster advertises (which nats-py adds to its pool on its own) carry none; so when
    every URL carries the same credentials they become the ``user``/``password`` (``token``)
    options, good for every server, and the URLs lose them. URLs with differing credentials
    stay as they are. A bare ``host:port`` after the first URL takes that URL's scheme and
    credentials (``nats://role:pw@nats-a:4222,nats-b:4222,nats-c:4222``: what compose's
    ``NATS_URL=nats://role:pw@${NATS_ADDRESS}`` becomes with a list of addresses)."""
    urls = split_urls(url) or [url]
    head = urlsplit(urls[0] if "://" in urls[0] else f"nats://{urls[0]}")
    prefix = f"{head.scheme}://" + (head.netloc.rpartition("@")[0] + "@" if "@" in head.netloc else "")
    urls = [urls[0], *(u if "://" in u else prefix + u for u in urls[1:])]
    parts = [urlsplit(u if "://" in u else f"nats://{u}") for u in urls]
    userinfo = {p.netloc.rpartition("@")[0] if "@" in p.netloc else None for p in parts}
    if len(userinfo) != 1 or None in userinfo:
        return urls, {}
    user, password = parts[0].username, parts[0].password
    options = {"user": unquote(user or ""), "password": unquote(password)} if password is not None \
        else {"token": unquote(user or "")}
    bare = [urlunsplit(p._replace(netloc=p.netloc.rpartition("@")[2])) for p in parts]
    return bare, options


async def connect(url: str, name: str, auth: NatsAuth | None = None, **options: object) -> Client:
    """The one way to the bus: connect with reconnects forever (services must outlive a NATS
    restart). ``url`` may carry ``user:password@`` or ``token@`` and may list several servers,
    comma-separated (a cluster: nats-py fails over between them and the servers they advertise,
    ``server_pool``); ``auth`` adds creds, nkey and TLS files (default: from the environment,
    ``NatsAuth.from_env``)."""
    auth = NatsAuth.from_env() if auth is None else auth
    servers, credentials = server_pool(url)
    defaults: dict[str, object] = dict(name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                       connect_timeout=5, allow_reconnect=True, **credentials)
    defaults.update(auth.connect_options())
    defaults.update(options)
    return await nats.connect(servers, **defaults)  # type: ignore[arg-type]
