"""A real three-node NATS cluster (``nats_server.NatsCluster``): routes on loopback with their own
password, JetStream on each node, streams and buckets with three replicas, clients that carry
every node's URL and fail over when theirs dies (killed by its own pid). Also the URL plumbing
that makes that work (``server_pool``, ``redact_url``) and `laswrr up`'s checks of the flags."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from laswrr.schemas import subjects as sj
from laswrr.services import accounts
from laswrr.services.natsbus import (StreamLimits, connect, ensure_checkpoint_bucket, ensure_streams, redact_url,
                                     server_pool, wait_jetstream)
from laswrr.services.nats_server import NatsCluster

pytestmark = pytest.mark.timeout(120)


def test_shared_credentials_become_options_good_for_every_server() -> None:
    urls, options = server_pool("nats://proxy:s3cr%40t@127.0.0.1:4001, nats://proxy:s3cr%40t@127.0.0.1:4002")
    assert urls == ["nats://127.0.0.1:4001", "nats://127.0.0.1:4002"]
    assert options == {"user": "proxy", "password": "s3cr@t"}
    assert server_pool("nats://tok@h:1,nats://tok@h:2") == (["nats://h:1", "nats://h:2"], {"token": "tok"})
    assert server_pool("nats://h:1,nats://h:2") == (["nats://h:1", "nats://h:2"], {})
    # compose's NATS_URL=nats://role:pw@${NATS_ADDRESS} with NATS_ADDRESS=a:4222,b:4222: the bare ones inherit
    assert server_pool("tls://r:pw@a:4222,b:4222") == (["tls://a:4222", "tls://b:4222"], {"user": "r", "password": "pw"})
    mixed = "nats://a:x@h:1,nats://b:y@h:2"  # differing credentials: each URL keeps its own
    assert server_pool(mixed) == (mixed.split(","), {})
    assert redact_url("nats://a:x@h:1,nats://b:y@h:2,nats://h:3") == "nats://a:***@h:1,nats://b:***@h:2,nats://h:3"


async def test_a_secure_cluster_replicates_and_its_clients_fail_over(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    passwords = accounts.new_passwords()
    config = accounts.write_private(tmp_path / "secrets" / "nats-server.conf", accounts.server_config(passwords))
    with NatsCluster(tmp_path, 3, log_dir=tmp_path, config_file=config) as cluster:
        assert all(os.stat(tmp_path / f"nats-{i}" / "nats-server.conf").st_mode & 0o077 == 0 for i in (1, 2, 3))
        url = ",".join(accounts.role_url("scheduler", passwords["scheduler"], n.host, n.port) for n in cluster.nodes)
        nc = await connect(url, "test")
        await wait_jetstream(nc, 30)
        js = nc.jetstream()
        for _ in range(50):  # the meta leader may not know every peer yet
            try:
                await ensure_streams(js, StreamLimits(replicas=3))
                break
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.2)
        await ensure_checkpoint_bucket(js, 3)
        for stream in (sj.EVENTS_STREAM, sj.OUT_STREAM, f"KV_{sj.WEIGHTS_BUCKET}", f"KV_{sj.CHECKPOINT_BUCKET}"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas) == 2
        with caplog.at_level(logging.WARNING, logger="laswrr.natsbus"):
            await ensure_streams(js, StreamLimits(replicas=1))  # a service started without --stream-replicas
        assert (await js.stream_info(sj.EVENTS_STREAM)).config.num_replicas == 3  # never reconfigured
        assert "num_replicas = 3 where this service would create 1" in caplog.text

        with pytest.raises(Exception, match="[Aa]uthorization"):  # every node has the users
            await connect(cluster.nodes[2].url, "nobody", max_reconnect_attempts=0, allow_reconnect=False,
                          connect_timeout=2)
        operator = ",".join(accounts.role_url("operator", passwords["operator"], n.host, n.port) for n in cluster.nodes)
        op = await connect(operator, "operator")
        ours = next(n for n in cluster.nodes if n.port == op.connected_url.port)
        assert ours.process is not None
        os.kill(ours.process.pid, signal.SIGKILL)
        acked = 0
        for i in range(20):  # publishes go on through another node (the stream leader may move)
            for _ in range(100):
                try:
                    await op.jetstream().publish(sj.admin_capacity("n1"), b'{"capacity": %d}' % i, timeout=2)
                    acked += 1
                    break
                except Exception:  # noqa: BLE001 - reconnecting, electing
                    await asyncio.sleep(0.1)
        assert acked == 20 and op.connected_url.port != ours.port
        assert (await js.stream_info(sj.EVENTS_STREAM)).state.messages == 20
        await op.close()
        index = cluster.nodes.index(ours)
        await asyncio.to_thread(cluster.restart, index)  # same ports and store: it rejoins
        for _ in range(200):
            replicas = (await js.stream_info(sj.EVENTS_STREAM)).cluster.replicas  # type: ignore[union-attr]
            if any(p.name == f"nats-{index + 1}" and p.current and not p.offline for p in replicas) or \
                    (await js.stream_info(sj.EVENTS_STREAM)).cluster.leader == f"nats-{index + 1}":  # type: ignore[union-attr]
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"nats-{index + 1} did not rejoin: {replicas}")
        await nc.close()


async def test_routes_need_their_password(tmp_path: Path) -> None:
    """The cluster port is not an open door: a route without the password is refused."""
    with NatsCluster(tmp_path, 2, log_dir=tmp_path) as cluster:
        reader, writer = await asyncio.open_connection(cluster.host, cluster.cluster_ports[0])
        info = await reader.readline()
        assert b'"auth_required":true' in info
        writer.write(b'CONNECT {"verbose":false,"user":"route","pass":"wrong","name":"intruder"}\r\nPING\r\n')
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(200), 5)
        assert b"Authorization Violation" in answer
        writer.close()


@pytest.mark.parametrize("args, message", [
    (["--stream-replicas", "3"], "--stream-replicas 3 needs at least as many NATS servers (--nats-cluster 1)"),
    (["--nats-cluster", "3", "--nats-url", "nats://127.0.0.1:1"], "cannot be combined with --nats-url"),
])
async def test_up_refuses_replicas_it_cannot_place(tmp_path: Path, args: list[str], message: str) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "laswrr", "up", "--data-dir", str(tmp_path),
                                                *args, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and message in err.decode()
