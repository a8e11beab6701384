"""The bus as `laswrr up` secures it: a real nats-server with the generated configuration
(services/accounts.py), each role connecting with its own password, and the attacks of an
open bus tried for real. The operator acts as the stock `nats` CLI would (plain publish, no
headers), through nats-py: the CLI is not installed on the test machines.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DeliverPolicy

from laswrr.schemas import subjects as sj
from laswrr.services import accounts
from laswrr.services.natsbus import NatsAuth, connect, ensure_streams
from laswrr.services.nats_server import EmbeddedNats
from laswrr.services.recorder import Recorder, RecorderOptions
from laswrr.services.scheduler_service import SchedulerOptions, SchedulerService

FORGED_SEQ = 2**53


@dataclass
class SecureBus:
    server: EmbeddedNats
    urls: dict[str, str]
    log_file: Path


@pytest.fixture
def bus(tmp_path: Path) -> Iterator[SecureBus]:
    passwords = accounts.new_passwords()
    config = accounts.write_private(tmp_path / "secrets" / "nats-server.conf", accounts.server_config(passwords))
    log_file = tmp_path / "nats.log"
    with EmbeddedNats(tmp_path / "nats", log_file=str(log_file), config_file=config) as server:
        urls = {role: accounts.role_url(role, pw, server.host, server.port) for role, pw in passwords.items()}
        yield SecureBus(server, urls, log_file)


class Errors:
    """Collects what the server sends a connection as -ERR (permissions violations)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on_error(self, exc: Exception) -> None:
        self.seen.append(str(exc))

    async def wait_for(self, words: str, timeout: float = 5.0) -> str:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            for text in self.seen:
                if words.lower() in text.lower():
                    return text
            await asyncio.sleep(0.02)
        raise AssertionError(f"no error with {words!r} from the server; seen: {self.seen}")


@contextlib.asynccontextmanager
async def as_role(bus: SecureBus, role: str, errors: Errors | None = None) -> AsyncIterator[Client]:
    nc = await connect(bus.urls[role], f"test-{role}", NatsAuth(), error_cb=(errors or Errors()).on_error, allow_reconnect=False)
    try:
        yield nc
    finally:
        await nc.close()


async def events_in_log(bus: SecureBus) -> int:
    async with as_role(bus, "scheduler") as nc:
        return (await nc.jetstream().stream_info(sj.EVENTS_STREAM)).state.messages


async def set_up_streams(bus: SecureBus) -> None:
    async with as_role(bus, "scheduler") as nc:
        await ensure_streams(nc.jetstream())


# -- who may connect ------------------------------------------------------------------------------


@pytest.mark.parametrize("url_of", [lambda bus: bus.server.url,  # anonymous
                                    lambda bus: bus.urls["operator"].replace("operator:", "operator:x")])
async def test_an_anonymous_or_wrong_password_connection_is_refused(bus: SecureBus, url_of: object) -> None:
    with pytest.raises(nats.errors.Error) as refused:
        await nats.connect(url_of(bus), allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,  # type: ignore[operator]
                           error_cb=Errors().on_error)
    assert "authorization violation" in str(refused.value).lower(), repr(refused.value)


# -- what each role may publish -------------------------------------------------------------------


async def test_the_proxy_cannot_publish_admin_events(bus: SecureBus) -> None:
    await set_up_streams(bus)
    errors = Errors()
    async with as_role(bus, "proxy", errors) as nc:
        await nc.publish(sj.admin_capacity("n1"), b'{"capacity": 1}')
        await nc.flush()
        violation = await errors.wait_for("Permissions Violation")
    assert 'permissions violation for publish to "lb.admin.capacity.n1"' in violation.lower()
    assert await events_in_log(bus) == 0  # nothing reached the log


async def test_the_operator_cannot_forge_weights_requests_or_streams(bus: SecureBus) -> None:
    await set_up_streams(bus)
    errors = Errors()
    forged = json.dumps({"pool": "default", "as_of_seq": FORGED_SEQ, "tick": 0, "ts_ns": 0, "nodes": []}).encode()
    async with as_role(bus, "operator", errors) as nc:
        await nc.publish(f"$KV.{sj.WEIGHTS_BUCKET}.default", forged)  # `nats kv put LB_WEIGHTS default ...`
        await nc.publish(sj.req_started("n1"), b'{"request_id": "r1", "proxy": "p"}')
        await nc.publish(f"$JS.API.STREAM.DELETE.{sj.EVENTS_STREAM}", b"")
        await nc.flush()
        for subject in (f"$KV.{sj.WEIGHTS_BUCKET}.default", "lb.req.started.n1", "$JS.API.STREAM.DELETE.LB_EVENTS"):
            await errors.wait_for(f'Permissions Violation for Publish to "{subject}"')
    async with as_role(bus, "scheduler") as nc:
        js = nc.jetstream()
        assert (await js.stream_info(f"KV_{sj.WEIGHTS_BUCKET}")).state.messages == 0
        assert (await js.stream_info(sj.EVENTS_STREAM)).state.messages == 0


async def test_the_proxy_publishes_its_batches(bus: SecureBus) -> None:
    await set_up_streams(bus)
    async with as_role(bus, "proxy") as nc:
        ack = await nc.jetstream().publish(sj.req_batch("p1"), b'{"events": [["proxy.heartbeat", null, {}]]}')
    assert ack.stream == sj.EVENTS_STREAM and await events_in_log(bus) == 1


async def test_a_proxy_reads_the_request_events_back_and_cannot_remove_them(bus: SecureBus) -> None:
    """The latency estimate shared by the replicas: a proxy reads ``lb.req.>`` of LB_EVENTS with an
    ordered consumer (services/proxy/bus.py, ``LatencyFeed``), and may not purge the stream."""
    await set_up_streams(bus)
    errors = Errors()
    async with as_role(bus, "proxy", errors) as nc:
        js = nc.jetstream()
        await js.publish(sj.req_batch("p1"), b'{"events": [["proxy.heartbeat", null, {}]]}')
        got: asyncio.Queue[str] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            await got.put(msg.subject)

        await js.subscribe(sj.REQ_ALL, stream=sj.EVENTS_STREAM, cb=on_msg, ordered_consumer=True,
                           config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=1))
        assert await asyncio.wait_for(got.get(), 10) == sj.req_batch("p1")
        with pytest.raises(nats.errors.Error):
            await js.purge_stream(sj.EVENTS_STREAM)
    assert await events_in_log(bus) == 1


async def test_proxies_talk_on_lb_peer_and_a_collector_cannot(bus: SecureBus) -> None:
    """The channel between proxies: one proxy's message reaches another (and a viewer), is stored
    nowhere, and a collector (or the viewer) publishing there is refused."""
    await set_up_streams(bus)
    subject = sj.peer("default", "proxy-a")
    async with as_role(bus, "proxy") as a, as_role(bus, "proxy") as b, as_role(bus, "viewer") as viewer:
        got_b, got_viewer = await b.subscribe(sj.PEER_ALL), await viewer.subscribe(sj.PEER_ALL)
        await b.flush()
        await viewer.flush()
        await a.publish(subject, b'{"proxy": "proxy-a"}')
        await a.flush()
        assert (await got_b.next_msg(timeout=5)).subject == subject
        assert (await got_viewer.next_msg(timeout=5)).subject == subject
        for role in ("collector", "viewer"):
            errors = Errors()
            async with as_role(bus, role, errors) as forger:
                await forger.publish(sj.peer("default", "proxy-b"), b'{"proxy": "proxy-b"}')
                await forger.flush()
                await errors.wait_for('Permissions Violation for Publish to "lb.peer.default.proxy-b"')
        with pytest.raises(nats.errors.TimeoutError):
            await got_b.next_msg(timeout=0.3)  # the forged ones never arrived
    assert await events_in_log(bus) == 0  # nothing on lb.peer is stored


@pytest.mark.parametrize(("role", "subject"), [
    ("collector", sj.admin_node("n1")), ("proxy", "lb.out.snapshot.default"), ("recorder", sj.req_started("n1")),
    ("collector", f"$KV.{sj.WEIGHTS_BUCKET}.default"), ("proxy", f"$KV.{sj.CHECKPOINT_BUCKET}.scheduler"),
    ("collector", sj.req_batch("p1")), ("operator", sj.req_batch("p1")),
])
async def test_services_publish_only_their_own_subjects(bus: SecureBus, role: str, subject: str) -> None:
    errors = Errors()
    async with as_role(bus, role, errors) as nc:
        await nc.publish(subject, b"{}")
        await nc.flush()
        await errors.wait_for(f'Permissions Violation for Publish to "{subject}"')


# -- the scheduler behind it ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_scheduler(bus: SecureBus, **options: object) -> AsyncIterator[SchedulerService]:
    nc = await connect(bus.urls["scheduler"], "test-scheduler", NatsAuth())
    service = SchedulerService(nc, SchedulerOptions(tick_ms=0, checkpoint_every=0, **options))  # type: ignore[arg-type]
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.ready.wait(), 15)
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await nc.close()


async def next_output(sub: object, subject_prefix: str, timeout: float = 10.0) -> dict[str, object]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        msg = await sub.next_msg(timeout=max(0.1, deadline - asyncio.get_running_loop().time()))  # type: ignore[attr-defined]
        if msg.subject.startswith(subject_prefix):
            return dict(json.loads(msg.data))


async def test_the_operator_changes_capacity_and_a_disallowed_node_is_rejected(bus: SecureBus) -> None:
    async with running_scheduler(bus, allow_upstream=("127.0.0.1",)), as_role(bus, "operator") as nc:
        outputs = await nc.subscribe("lb.out.>")  # `nats sub 'lb.out.>'`
        await nc.publish(sj.admin_node("n1"), b'{"url": "http://127.0.0.1:8000", "capacity": 8}')  # `nats pub`
        registered = await next_output(outputs, sj.OUT_SNAPSHOT)
        assert [n["node"] for n in registered["nodes"]] == ["n1"]  # type: ignore[index]
        await nc.publish(sj.admin_capacity("n1"), b'{"capacity": 1}')
        while True:  # the snapshot that shows the change
            snapshot = await next_output(outputs, sj.OUT_SNAPSHOT)
            if snapshot["nodes"][0]["capacity"] == 1:  # type: ignore[index]
                break
        bucket = await nc.jetstream().key_value(sj.WEIGHTS_BUCKET)
        for _ in range(100):  # the bucket's put may land just after the lb.out snapshot (CI saw 8 once)
            entry = await bucket.get("default")  # `nats kv get`
            if json.loads(entry.value or b"{}")["nodes"][0]["capacity"] == 1:
                break
            await asyncio.sleep(0.1)
        assert json.loads(entry.value or b"{}")["nodes"][0]["capacity"] == 1
        info = await nc.jetstream().stream_info(sj.EVENTS_STREAM)  # `nats stream info LB_EVENTS`
        assert info.state.messages >= 2

        await nc.publish(sj.admin_node("evil"), b'{"url": "http://169.254.169.254/latest", "capacity": 8}')
        rejected = await next_output(outputs, sj.OUT_REJECTED)
        assert rejected["subject"] == sj.admin_node("evil")
        assert "169.254.169.254:80 is not in the allow-list (127.0.0.1)" in str(rejected["reason"])
        await nc.publish(sj.admin_node("sneaky"), b'{"url": "http://u:p@127.0.0.1:8000", "capacity": 8}')
        rejected = await next_output(outputs, sj.OUT_REJECTED)
        assert "user info" in str(rejected["reason"])


async def test_a_forged_snapshot_beyond_the_log_is_replaced_by_the_scheduler(tmp_path: Path, nats_url: str) -> None:
    """On an open bus (or before security): a stray writer put as_of_seq 2^53 into LB_WEIGHTS."""
    nc = await connect(nats_url, "attacker", NatsAuth())
    js = nc.jetstream()
    await ensure_streams(js)
    forged = {"pool": "default", "as_of_seq": FORGED_SEQ, "tick": 0, "ts_ns": 0, "panic": False,
              "nodes": [{"node": "evil", "url": "http://attacker:80", "phase": "active", "routable": True,
                         "capacity": 100, "target_weight": 100, "effective_weight": 100, "inflight": 0}]}
    kv = await js.key_value(sj.WEIGHTS_BUCKET)
    await kv.put("default", json.dumps(forged).encode())
    scheduler_nc = await connect(nats_url, "scheduler", NatsAuth())
    service = SchedulerService(scheduler_nc, SchedulerOptions(tick_ms=0, checkpoint_every=0))
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.ready.wait(), 15)
        await js.publish(sj.admin_node("n1"), b'{"url": "http://127.0.0.1:8000", "capacity": 8}')
        for _ in range(100):
            snapshot = json.loads((await kv.get("default")).value or b"{}")
            if snapshot["as_of_seq"] < FORGED_SEQ:
                break
            await asyncio.sleep(0.1)
        assert snapshot["as_of_seq"] == 1 and [n["node"] for n in snapshot["nodes"]] == ["n1"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await scheduler_nc.close()
        await nc.close()


# -- the recorder's copies ------------------------------------------------------------------------


async def test_the_recorder_writes_copies_only_under_its_data_dir(bus: SecureBus, tmp_path: Path) -> None:
    await set_up_streams(bus)
    data_dir = tmp_path / "recorder"
    nc = await connect(bus.urls["recorder"], "test-recorder", NatsAuth())
    recorder = Recorder(nc, RecorderOptions(data_dir=data_dir, flush_ms=50))
    stop = asyncio.Event()
    task = asyncio.create_task(recorder.run(stop))
    try:
        await asyncio.wait_for(recorder.ready.wait(), 15)
        db = str(data_dir / "events.duckdb")
        async with as_role(bus, "operator") as operator:
            for target in (tmp_path / "elsewhere.duckdb", data_dir / ".." / "escape.duckdb", Path("/etc/cron.d/x")):
                reply = json.loads((await operator.request(sj.RECORDER_SNAPSHOT, json.dumps(
                    {"db": db, "to": str(target)}).encode(), timeout=10)).data)
                assert "not inside the recorder's data directory" in reply["error"], reply
                assert not target.exists()
            inside = data_dir / "copy.duckdb"
            reply = json.loads((await operator.request(sj.RECORDER_SNAPSHOT, json.dumps(
                {"db": db, "to": str(inside)}).encode(), timeout=20)).data)
            assert reply == {"path": str(inside)} and inside.exists()
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await nc.close()


# -- TLS ------------------------------------------------------------------------------------------


def _certificate_authority(name: str) -> tuple[object, object]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _write_tls(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate it signed for 127.0.0.1, and a second, unrelated CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key, ca_cert = _certificate_authority("laswrr test CA")
    _, other_ca = _certificate_authority("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())  # type: ignore[attr-defined]
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    pem = serialization.Encoding.PEM
    paths = {name: directory / f"{name}.pem" for name in ("ca", "other_ca", "cert", "key")}
    paths["ca"].write_bytes(ca_cert.public_bytes(pem))  # type: ignore[attr-defined]
    paths["other_ca"].write_bytes(other_ca.public_bytes(pem))  # type: ignore[attr-defined]
    paths["cert"].write_bytes(cert.public_bytes(pem))
    paths["key"].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


async def test_tls_with_the_right_ca_connects_and_a_wrong_ca_is_refused(tmp_path: Path) -> None:
    tls = _write_tls(tmp_path)
    passwords = accounts.new_passwords()
    config = accounts.write_private(tmp_path / "secrets" / "nats-server.conf", accounts.server_config(
        passwords, tls_cert=str(tls["cert"]), tls_key=str(tls["key"])))
    with EmbeddedNats(tmp_path / "nats", log_file=str(tmp_path / "nats.log"), config_file=config) as server:
        url = accounts.role_url("scheduler", passwords["scheduler"], server.host, server.port, scheme="tls")
        nc = await connect(url, "tls-ok", NatsAuth(tls_ca=str(tls["ca"])), allow_reconnect=False)
        try:
            await ensure_streams(nc.jetstream())  # a JetStream round trip over TLS
            assert nc.is_connected
        finally:
            await nc.close()
        with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):
            await connect(url, "tls-wrong-ca", NatsAuth(tls_ca=str(tls["other_ca"])), allow_reconnect=False,
                          max_reconnect_attempts=0, connect_timeout=2, error_cb=Errors().on_error)
        plain = accounts.role_url("scheduler", passwords["scheduler"], server.host, server.port)
        with pytest.raises((nats.errors.Error, OSError)):  # no CA given: the server's TLS is not accepted blindly
            await connect(plain, "no-tls", NatsAuth(), allow_reconnect=False, max_reconnect_attempts=0,
                          connect_timeout=2, error_cb=Errors().on_error)


async def test_an_nkey_user_connects_with_its_seed_file_only(tmp_path: Path) -> None:
    import nkeys

    seed = nkeys.encode_seed(bytes(range(32)), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed + b"\n")
    config = tmp_path / "nkey.conf"
    config.write_text('authorization { users = [ {nkey: "%s"} ] }\n' % public)
    with EmbeddedNats(tmp_path / "nats", log_file=str(tmp_path / "nats.log"), config_file=config) as server:
        nc = await connect(server.url, "nkey-user", NatsAuth(nkey=str(seed_file)), allow_reconnect=False)
        try:
            await ensure_streams(nc.jetstream())
        finally:
            await nc.close()
        with pytest.raises(nats.errors.Error):
            await connect(server.url, "no-seed", NatsAuth(), allow_reconnect=False, max_reconnect_attempts=0,
                          connect_timeout=2, error_cb=Errors().on_error)


def test_credential_files_come_from_flags_or_environment(tmp_path: Path) -> None:
    auth = NatsAuth.from_env({"NATS_CREDS": "/c", "NATS_TLS_CA": "/ca", "UNRELATED": "x"})
    assert auth == NatsAuth(creds="/c", tls_ca="/ca")
    assert auth.env() == {"NATS_CREDS": "/c", "NATS_TLS_CA": "/ca"}
    with pytest.raises(FileNotFoundError, match="NATS credential file /c does not exist"):
        auth.connect_options()
    seed = tmp_path / "user.nk"
    seed.write_text("SUAMK2FG4MI6UE3ACF3FK3OIQBCEIEZV7NSWFFEW63UXMRLFM2XLAXK4GY\n")
    assert NatsAuth(nkey=str(seed)).connect_options() == {"nkeys_seed": str(seed)}
