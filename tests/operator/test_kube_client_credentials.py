"""Our Kubernetes API client's credentials, loaded by the `kubernetes` package: an exec credential plugin
(a script written here that prints an ExecCredential and counts its runs) against kmock's emulator on
127.0.0.1, its token fetched again when it expires and after a 401, a plugin that fails; and, against a
small TLS server here (kmock serves plain HTTP), client certificates, `insecure-skip-tls-verify` and the
in-cluster service account with its rotating token file."""

import base64
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml
from aiohttp import web
from kmock import Server
from kube_emulator import EmulatedCluster
from kubernetes.config import incluster_config

from inharness.operator.kube import CONFIGMAPS, KubeClient, KubeError

PLUGIN = """
import datetime, json, os, sys
from pathlib import Path

info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])  # the exec protocol's input
assert info["kind"] == "ExecCredential", info
runs = Path(sys.argv[1])
n = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(n))
if os.environ.get("PLUGIN_FAIL"):
    sys.exit("boom: run `cloud login` first")
status = {"token": f"token-{n}"}
if os.environ.get("PLUGIN_EXPIRES_IN"):
    expires_in = datetime.timedelta(seconds=int(os.environ["PLUGIN_EXPIRES_IN"]))
    at = datetime.datetime.now(datetime.UTC) + expires_in
    status["expirationTimestamp"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": status}
print(json.dumps(credential))
"""

EMPTY_LIST = {"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {"resourceVersion": "1"}, "items": []}


def unauthorized(message: str) -> dict[str, Any]:
    return {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "message": message, "code": 401}


def kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": "test", "user": user}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


class Plugin:
    """The exec plugin: `token-<n>` on its n-th run, optionally expiring `expires_in` seconds later."""

    def __init__(self, root: Path) -> None:
        self.script, self.counter = root / "plugin.py", root / "plugin-runs"
        self.script.write_text(PLUGIN)

    @property
    def runs(self) -> int:
        return int(self.counter.read_text()) if self.counter.exists() else 0

    def user(self, *, expires_in: int | None = None, fail: bool = False) -> dict[str, Any]:
        env = [{"name": "PLUGIN_EXPIRES_IN", "value": str(expires_in)}] if expires_in else []
        env += [{"name": "PLUGIN_FAIL", "value": "1"}] if fail else []
        return {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": sys.executable,
                "args": [str(self.script), str(self.counter)],
                "env": env,
                "interactiveMode": "Never",
            }
        }


@pytest.fixture
def outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    return monkeypatch


@pytest.fixture
async def emulator() -> AsyncIterator[tuple[EmulatedCluster, str]]:
    async with EmulatedCluster() as k8s, Server(k8s) as server:
        yield k8s, str(server.url).rstrip("/")


def authorizations(k8s: EmulatedCluster) -> list[str | None]:
    """The Authorization header of every request the emulator received, in order."""
    return [r.headers.get("Authorization") for r in k8s]


async def test_exec_plugin_token_reaches_the_emulator(
    emulator: tuple[EmulatedCluster, str], tmp_path: Path, outside_a_pod: pytest.MonkeyPatch
) -> None:
    """The plugin runs once: a token an hour from expiry is not due, however often the client asks."""
    k8s, url = emulator
    plugin = Plugin(tmp_path)
    config = kubeconfig(tmp_path / "config", {"server": url}, plugin.user(expires_in=3600))
    outside_a_pod.setenv("KUBECONFIG", str(config))
    async with KubeClient.from_environment(renew_seconds=0) as kube:
        for _ in range(3):
            assert await kube.list(CONFIGMAPS, "ns") == []
    assert plugin.runs == 1
    assert authorizations(k8s) == ["Bearer token-1"] * 3


async def test_expiring_exec_token_is_fetched_again(
    emulator: tuple[EmulatedCluster, str], tmp_path: Path, outside_a_pod: pytest.MonkeyPatch
) -> None:
    """A token a minute from expiry is due (the loader renews 5 minutes ahead): each renewal runs the
    plugin again, and each request carries the newest token."""
    k8s, url = emulator
    plugin = Plugin(tmp_path)
    config = kubeconfig(tmp_path / "config", {"server": url}, plugin.user(expires_in=60))
    outside_a_pod.setenv("KUBECONFIG", str(config))
    async with KubeClient.from_environment(renew_seconds=0) as kube:
        for _ in range(3):
            assert await kube.list(CONFIGMAPS, "ns") == []
    assert plugin.runs == 3
    assert authorizations(k8s) == ["Bearer token-1", "Bearer token-2", "Bearer token-3"]
    # Between renewals (every 30 s by default) the token in hand is used, with no run of the plugin.
    async with KubeClient.from_environment() as kube:
        for _ in range(3):
            assert await kube.list(CONFIGMAPS, "ns") == []
    assert plugin.runs == 4
    assert authorizations(k8s)[3:] == ["Bearer token-4"] * 3


async def test_a_401_logs_in_again_once(
    emulator: tuple[EmulatedCluster, str], tmp_path: Path, outside_a_pod: pytest.MonkeyPatch
) -> None:
    """A token the server refuses (revoked, or expired with no expirationTimestamp to tell) is fetched
    again and the request sent once more; refused again, the 401 is the caller's."""
    k8s, url = emulator
    k8s[kmock.headers({"Authorization": "Bearer token-1"})] << 401 << unauthorized("token-1 revoked")
    plugin = Plugin(tmp_path)
    outside_a_pod.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", {"server": url}, plugin.user())))
    async with KubeClient.from_environment() as kube:
        assert await kube.list(CONFIGMAPS, "ns") == []
        assert kube.requests["list"] == 2 and plugin.runs == 2
        assert authorizations(k8s) == ["Bearer token-1", "Bearer token-2"]

        k8s[kmock.headers({"Authorization": "Bearer token-2"})] << 401 << unauthorized("token-2 revoked")
        k8s[kmock.headers({"Authorization": "Bearer token-3"})] << 401 << unauthorized("token-3 revoked")
        with pytest.raises(KubeError) as refused:
            await kube.list(CONFIGMAPS, "ns")
        assert refused.value.status == 401 and refused.value.message == "token-3 revoked"
        assert kube.requests["list"] == 4 and plugin.runs == 3

    # Fixed credentials have nothing to log in again with: the first 401 is the caller's.
    async with KubeClient(url, "token-1") as kube:
        with pytest.raises(KubeError, match="token-1 revoked"):
            await kube.list(CONFIGMAPS, "ns")
        assert kube.requests["list"] == 1


async def test_a_failing_exec_plugin_is_named(
    emulator: tuple[EmulatedCluster, str], tmp_path: Path, outside_a_pod: pytest.MonkeyPatch
) -> None:
    k8s, url = emulator
    plugin = Plugin(tmp_path)
    config = kubeconfig(tmp_path / "config", {"server": url}, plugin.user(fail=True))
    outside_a_pod.setenv("KUBECONFIG", str(config))
    async with KubeClient.from_environment() as kube:
        with pytest.raises(KubeError) as failed:
            await kube.list(CONFIGMAPS, "ns")
    assert failed.value.reason == "ExecPluginFailed"
    assert repr(sys.executable) in failed.value.message and "user 'test'" in failed.value.message
    assert "exec: process returned 1. boom: run `cloud login` first" in failed.value.message
    assert plugin.runs == 1 and authorizations(k8s) == []


async def test_no_credentials_says_where_it_looked(tmp_path: Path, outside_a_pod: pytest.MonkeyPatch) -> None:
    outside_a_pod.setenv("KUBECONFIG", str(tmp_path / "absent"))
    async with KubeClient.from_environment() as kube:
        with pytest.raises(KubeError) as none:
            await kube.list(CONFIGMAPS, "ns")
    assert none.value.reason == "NoCredentials"
    assert "not in a pod" in none.value.message and str(tmp_path / "absent") in none.value.message


# -- TLS ---------------------------------------------------------------------------------------------


class Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (CN=operator), by openssl."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca, self.ca_key = self._make("ca", None, "")
        self.server, self.server_key = self._make("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1")
        self.client, self.client_key = self._make("client", "operator", "extendedKeyUsage=clientAuth")

    def _make(self, name: str, cn: str | None, extensions: str) -> tuple[Path, Path]:
        crt, key = self.root / f"{name}.crt", self.root / f"{name}.key"
        newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key)]
        if cn is None:
            cmd = ["openssl", "req", "-x509", *newkey, "-out", str(crt), "-days", "1", "-subj", "/CN=test-ca"]
            subprocess.run(cmd, check=True, capture_output=True)
            return crt, key
        csr, ext = self.root / f"{name}.csr", self.root / f"{name}.ext"
        ext.write_text(extensions + "\n")
        req = ["openssl", "req", *newkey, "-out", str(csr), "-subj", f"/CN={cn}"]
        subprocess.run(req, check=True, capture_output=True)
        sign = ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key)]
        sign += ["-CAcreateserial", "-out", str(crt), "-days", "1", "-extfile", str(ext)]
        subprocess.run(sign, check=True, capture_output=True)
        return crt, key


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


class TlsServer:
    """Answers every request with an empty list, after recording its Authorization header and the
    client certificate's CN (client certificates are optional); refuses the tokens in `refused`."""

    def __init__(self, pki: Pki) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
        self.context.load_cert_chain(pki.server, pki.server_key)
        self.context.verify_mode = ssl.CERT_OPTIONAL
        self.seen: list[tuple[str | None, str | None]] = []
        self.refused: set[str] = set()

    async def handle(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        cn = dict(item[0] for item in peer["subject"])["commonName"] if peer else None
        authorization = request.headers.get("Authorization")
        self.seen.append((authorization, cn))
        if authorization in self.refused:
            return web.json_response(unauthorized("refused"), status=401)
        return web.json_response(EMPTY_LIST)

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.context).start()
        return f"https://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


async def test_client_certificate_and_ca_from_kubeconfig_data(
    pki: Pki, tmp_path: Path, outside_a_pod: pytest.MonkeyPatch
) -> None:
    """Inline base64 PEM (`-data` keys): the loader writes the files that ssl loads."""
    tls = TlsServer(pki)
    async with tls as url:
        cluster = {"server": url, "certificate-authority-data": b64(pki.ca)}
        user = {"client-certificate-data": b64(pki.client), "client-key-data": b64(pki.client_key)}
        outside_a_pod.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", cluster, user)))
        async with KubeClient.from_environment() as kube:
            assert await kube.list(CONFIGMAPS, "ns") == []
    assert tls.seen == [(None, "operator")]


async def test_tls_client_certificate_files_insecure_and_verification(
    pki: Pki, tmp_path: Path, outside_a_pod: pytest.MonkeyPatch
) -> None:
    tls = TlsServer(pki)
    async with tls as url:
        # Certificate files, relative to the kubeconfig's directory, as kubectl reads them.
        cluster = {"server": url, "certificate-authority": "ca.crt"}
        user = {"client-certificate": "client.crt", "client-key": "client.key"}
        config = kubeconfig(pki.root / "config", cluster, user)
        outside_a_pod.setenv("KUBECONFIG", str(config))
        async with KubeClient.from_environment() as kube:
            assert await kube.list(CONFIGMAPS, "ns") == []
        assert tls.seen == [(None, "operator")]

        # No CA: the server's certificate cannot be verified, unless the kubeconfig says not to.
        config = kubeconfig(tmp_path / "config", {"server": url}, {"token": "t"})
        outside_a_pod.setenv("KUBECONFIG", str(config))
        async with KubeClient.from_environment() as kube:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await kube.list(CONFIGMAPS, "ns")
        config = kubeconfig(
            tmp_path / "config", {"server": url, "insecure-skip-tls-verify": True}, {"token": "t"}
        )
        async with KubeClient.from_environment() as kube:
            assert await kube.list(CONFIGMAPS, "ns") == []
        assert tls.seen[1:] == [("Bearer t", None)]


async def test_in_cluster_service_account_and_its_rotating_token(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod: the service account's token and CA. The kubelet rotates the token file; a 401 on the
    old token re-reads it (so does the loader's own minute-by-minute renewal)."""
    token = tmp_path / "token"
    token.write_text("sa-token-1")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(pki.ca))
    tls = TlsServer(pki)
    async with tls as url:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", url.rsplit(":", 1)[1])
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
        async with KubeClient.from_environment() as kube:
            assert await kube.list(CONFIGMAPS, "ns") == []
            token.write_text("sa-token-2")
            tls.refused.add("bearer sa-token-1")
            assert await kube.list(CONFIGMAPS, "ns") == []
            assert kube.requests["list"] == 3
    assert tls.seen == [("bearer sa-token-1", None), ("bearer sa-token-1", None), ("bearer sa-token-2", None)]
