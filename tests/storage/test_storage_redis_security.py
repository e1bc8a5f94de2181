"""The Redis server's own security, used by kvcached: an ACL user with a password
(``redis://user:pass@host:port``) limited to kvcached's keys and commands, and
TLS (``rediss://``, certificates made here, the server checks the client's too).
The password never shows: not in stats, errors, logs, ``kvcached status``, nor
the run directory's config.json, while the workers still get the real URL."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from conftest import tiny_config, toks  # noqa: E402
from conftest_storage import (  # noqa: E402
    LAYOUT,
    NO_REDIS_REASON,
    REDIS_SERVER,
    die_with_parent,
    free_port,
    make_hashes,
    make_pool,
    port_open,
    stop_process,
    wait_until,
)

from kvcached import CacheManager  # noqa: E402
from kvcached.storage import BlockStore, open_backend, storage_namespace  # noqa: E402
from kvcached.transfer.endpoints import CONFIG_FILE  # noqa: E402
from kvcached.transfer.runconfig import CREDENTIALS_FILE  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS_REASON)
redis = pytest.importorskip("redis")

PW = "Kv-acl-Passw0rd-7f3e"
ADMIN_PW = "admin-Passw0rd-91c2"
# Least privilege: kvcached's keys only, and the commands its backend sends
# (INFO is refused: the backend then takes the server for a standalone one).
ACL = ["on", f">{PW}", "resetkeys", "~kvcached/*", "resetchannels", "-@all", "+exists",
       "+getrange", "+set", "+unlink", "+ping", "+scan"]
N = 4


class Server:
    """A redis-server started by the test: plain or TLS only, an ACL user ``kv``."""

    def __init__(self, workdir: Path, tls: dict | None = None):
        self.workdir, self.tls, self.port = workdir, tls, free_port()
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir), "--logfile", str(workdir / f"redis-{self.port}.log")]
        if tls:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", tls["server_cert"], "--tls-key-file", tls["server_key"],
                     "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "yes"]
        else:
            args += ["--port", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        wait_until(lambda: self.proc.poll() is not None or port_open(self.port), 10,
                   f"redis-server on {self.port}")
        assert self.proc.poll() is None, f"redis-server exited ({self.proc.returncode})"
        admin = redis.Redis(host="127.0.0.1", port=self.port, **self._tls_kwargs())
        wait_until(lambda: _ping(admin), 10, "redis PING")
        admin.acl_setuser("kv", reset=True)
        admin.execute_command("ACL", "SETUSER", "kv", *ACL)
        admin.config_set("requirepass", ADMIN_PW)  # the default user: the admin's
        admin.close()

    def _tls_kwargs(self) -> dict:
        if not self.tls:
            return {}
        return dict(ssl=True, ssl_ca_certs=self.tls["ca"], ssl_certfile=self.tls["client_cert"],
                    ssl_keyfile=self.tls["client_key"])

    def admin(self):
        return redis.Redis(host="127.0.0.1", port=self.port, password=ADMIN_PW,
                           **self._tls_kwargs())

    def url(self, password: str = PW, query: str = "") -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://kv:{password}@127.0.0.1:{self.port}/0{query}"

    def stop(self) -> None:
        stop_process(self.proc)


def _ping(client) -> bool:
    try:
        return client.ping()
    except redis.exceptions.RedisError:
        return False


# ------------------------------------------------------------------ certificates
def make_certs(d: Path) -> dict:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (PEM files)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, ca=False, san=None, usage=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(path, obj):
        if isinstance(obj, x509.Certificate):
            data = obj.public_bytes(serialization.Encoding.PEM)
        else:
            data = obj.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        p = d / path
        p.write_bytes(data)
        return str(p)

    out = {}
    for ca_name in ("ca", "other_ca"):
        k = ec.generate_private_key(ec.SECP256R1())
        c = cert(f"kvcached test {ca_name}", k, f"kvcached test {ca_name}", k, ca=True)
        out[ca_name], out[ca_name + "_key"] = write(f"{ca_name}.crt", c), k
        out[ca_name + "_cert"] = c
    ca_key = out.pop("ca_key")
    out.pop("other_ca_key"), out.pop("other_ca_cert"), out.pop("ca_cert")
    for who, san, usage in (
            ("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
             ExtendedKeyUsageOID.SERVER_AUTH),
            ("client", None, ExtendedKeyUsageOID.CLIENT_AUTH)):
        k = ec.generate_private_key(ec.SECP256R1())
        out[f"{who}_cert"] = write(f"{who}.crt", cert(who, k, "kvcached test ca", ca_key,
                                                      san=san, usage=usage))
        out[f"{who}_key"] = write(f"{who}.key", k)
    return out


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("redis-acl"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis-tls")
    srv = Server(d, tls=make_certs(d))
    yield srv
    srv.stop()


def roundtrip(url: str, **opts) -> BlockStore:
    be = open_backend("redis", url, socket_timeout_s=2.0, connect_timeout_s=2.0, **opts)
    bs = BlockStore(be, LAYOUT.digest, 0, 1, storage_namespace("kvcached-demo", "0"))
    pool, hashes = make_pool(N, seed=11), make_hashes(N, seed=11)
    assert all(bs.store(hashes, pool, list(range(N)))), bs.stats()
    out = torch.zeros_like(pool)
    assert bs.load(hashes, out, list(range(N))) == N and torch.equal(out, pool)
    return bs


def assert_hidden(*texts):
    for t in texts:
        assert PW not in t and ADMIN_PW not in t, t


# ------------------------------------------------------------------ ACL user
def test_acl_user_with_a_password(acl_server, caplog):
    caplog.set_level(logging.DEBUG)
    bs = roundtrip(acl_server.url())
    st = bs.stats()
    assert st["backend"]["url"] == f"redis://kv:***@127.0.0.1:{acl_server.port}/0"
    assert st["backend"]["errors"] == 0 and not st["backend"]["cluster"]
    bs.close()
    # The ACL holds: the user reads and writes kvcached's keys only.
    kv = redis.Redis(host="127.0.0.1", port=acl_server.port, username="kv", password=PW)
    with pytest.raises(redis.exceptions.NoPermissionError):
        kv.set("not-kvcached", b"x")
    kv.close()
    # A wrong password: misses and a counted error, never the password.
    be = open_backend("redis", acl_server.url(PW + "-wrong"), socket_timeout_s=1.0,
                      breaker_threshold=1)
    bs = BlockStore(be, LAYOUT.digest, 0, 1, storage_namespace("kvcached-demo", "0"))
    assert bs.load(make_hashes(1, seed=11), make_pool(1), [0]) == 0
    st = be.stats()
    assert st["errors"] >= 1 and st["last_error"], st
    bs.close()
    assert_hidden(repr(st), caplog.text)


# ------------------------------------------------------------------ TLS
def test_tls_with_client_certificates(tls_server, caplog):
    caplog.set_level(logging.DEBUG)
    tls = tls_server.tls
    q = (f"?ssl_ca_certs={tls['ca']}&ssl_certfile={tls['client_cert']}"
         f"&ssl_keyfile={tls['client_key']}")
    bs = roundtrip(tls_server.url(query=q))
    assert bs.stats()["backend"]["url"].startswith(f"rediss://kv:***@127.0.0.1:{tls_server.port}")
    bs.close()
    # A server whose certificate another CA signed is refused (no data goes out),
    # as are a client without a certificate and one speaking plain TCP.
    bad = {
        "other_ca": (f"?ssl_ca_certs={tls['other_ca']}&ssl_certfile={tls['client_cert']}"
                     f"&ssl_keyfile={tls['client_key']}"),
        "no_client_cert": f"?ssl_ca_certs={tls['ca']}",
    }
    for case, query in bad.items():
        be = open_backend("redis", tls_server.url(query=query), socket_timeout_s=1.0,
                          connect_timeout_s=1.0, breaker_threshold=1)
        assert be.put_from(["ns/a"], [b"x"]) == [False], case
        st = be.stats()
        assert st["errors"] >= 1, (case, st)
        assert_hidden(repr(st))
        be.close()
    plain = open_backend("redis", tls_server.url().replace("rediss://", "redis://"),
                         socket_timeout_s=1.0, connect_timeout_s=1.0, breaker_threshold=1)
    assert plain.put_from(["ns/a"], [b"x"]) == [False]
    assert_hidden(repr(plain.stats()))
    plain.close()
    assert_hidden(caplog.text)
    assert tls_server.admin().dbsize() == N  # only the honest client's objects


# ------------------------------------------------------------------ run dir, workers
FAST = dict(transfer_mode="workers", heartbeat_interval_s=0.1, worker_timeout_s=2.0,
            engine_timeout_s=5.0, task_timeout_s=10.0, worker_start_timeout_s=60.0,
            tp_size=1, num_gpu_blocks=16, num_cpu_blocks=16, model_id="m")


def _stores_done(mgr) -> bool:
    t = mgr.stats().transfers.get("store", {})
    return t.get("done", 0) + t.get("failed", 0) == t.get("submitted", 0)


def compute(mgr, rid: str, blocks: list[int]) -> None:
    prompt = toks(*blocks, tail=1)
    mgr.allocate(rid, prompt).wait(10)
    mgr.commit(rid, prompt, len(prompt))
    mgr.free(rid)
    wait_until(lambda: _stores_done(mgr), 10, "the stores to finish")


def test_workers_get_the_password_config_json_does_not(acl_server, tmp_path):
    """Spawned workers read run_dir/config.json: it shows the URL redacted, the
    password lives in credentials.json (0600) and reaches the workers, a
    restarted one included; status and the logs never show it."""
    run = tmp_path / "run"
    admin = acl_server.admin()
    admin.flushdb()
    cfg = tiny_config(**FAST, run_dir=str(run), storage_backend="redis",
                      storage_url=acl_server.url())
    with CacheManager(cfg) as mgr:
        written = (run / CONFIG_FILE).read_text()
        assert_hidden(written)
        assert json.loads(written)["storage_url"] == \
            f"redis://kv:***@127.0.0.1:{acl_server.port}/0"
        cred = run / CREDENTIALS_FILE
        assert stat.S_IMODE(cred.stat().st_mode) == 0o600
        assert json.loads(cred.read_text())["storage_url"] == acl_server.url()
        compute(mgr, "a", [1, 2])
        pid = mgr.stats().workers[0]["pid"]
        os.kill(pid, signal.SIGKILL)  # the restarted worker reads the run dir again
        wait_until(lambda: (w := mgr.stats().workers[0])["pid"] != pid
                   and w["state"] == "ready", 30, "rank 0 to come back")
        compute(mgr, "b", [3, 4, 5])
        st = mgr.stats().storage
        assert st.get("stored") == 5 and st.get("store_failed", 0) == 0, st
        assert admin.dbsize() == 5
        assert_hidden(json.dumps(mgr.status(), default=str))
    assert not (run / CREDENTIALS_FILE).exists()  # gone with the engine
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*") if p.is_file())
    assert_hidden(logs)


def test_run_config_keeps_the_password_apart(tmp_path):
    from kvcached.ops.cleanup import RUN_DIR_LEFTOVERS
    from kvcached.transfer.runconfig import read_run_config, write_run_config

    url = f"redis://kv:{PW}@127.0.0.1:6379/0"
    cfg = tiny_config(storage_backend="redis", storage_url=url, model_id="m", num_cpu_blocks=4)
    write_run_config(tmp_path, cfg)
    assert_hidden((tmp_path / CONFIG_FILE).read_text())
    assert read_run_config(tmp_path)["storage_url"] == url
    # Credentials for another URL are not used for this one.
    (tmp_path / CREDENTIALS_FILE).write_text(json.dumps(
        {"storage_url": f"redis://kv:{PW}@10.0.0.1:6379/0"}))
    assert read_run_config(tmp_path)["storage_url"] == "redis://kv:***@127.0.0.1:6379/0"
    write_run_config(tmp_path, cfg.replace(storage_url="redis://127.0.0.1:6379"))
    assert not (tmp_path / CREDENTIALS_FILE).exists()
    assert read_run_config(tmp_path)["storage_url"] == "redis://127.0.0.1:6379"
    assert CREDENTIALS_FILE in RUN_DIR_LEFTOVERS  # `kvcached cleanup` removes it
