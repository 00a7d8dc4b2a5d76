"""SSRF-safe remote image fetching against a local HTTP server (spec ds4-vision §6.2)."""

from __future__ import annotations

import io
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from ds4serve.multimodal import fetch
from ds4serve.multimodal.fetch import FetchPolicy, fetch_image_bytes, host_allowed, is_public_address
from ds4serve.config import VisionConfig
from ds4serve.multimodal.images import ImageError, ImageLimits, decode_image
from ds4serve.multimodal.pipeline import ImagePipeline


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20, 10), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()
BIG = 2 * 2**20
CAP = 2**20


class Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []  # Host headers seen, to check that the name (not the IP) is sent

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):  # noqa: N802 - http.server naming
        Handler.hosts.append(self.headers.get("Host", ""))
        route = getattr(self, "_route_" + self.path.strip("/").replace("-", "_").replace(".", "_"), None)
        try:
            (route or self._route_404)()
        except OSError:  # the client hung up on purpose (size cap, timeout)
            pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, length: bool = True):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route_img_png(self):
        self._send(200, PNG, {"Content-Type": "image/png"})

    def _route_huge(self):
        self._send(200, b"\0" * BIG)

    def _route_huge_stream(self):  # no Content-Length: only the running count can stop it
        self.send_response(200)
        self.end_headers()
        for _ in range(BIG // 65536):
            self.wfile.write(b"\0" * 65536)

    def _route_short(self):  # promises more than it sends, then closes
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG) + 100))
        self.end_headers()
        self.wfile.write(PNG)

    def _route_slow(self):
        time.sleep(1.0)
        self._send(200, PNG)

    def _route_drip_headers(self):  # every read succeeds quickly, but the response never ends
        self.wfile.write(b"HTTP/1.0 200 OK\r\n")
        for i in range(40):
            self.wfile.write(f"X-Drip-{i}: x\r\n".encode())
            self.wfile.flush()
            time.sleep(0.05)

    def _route_drip_body(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        for _ in range(40):
            self.wfile.write(b"x")
            self.wfile.flush()
            time.sleep(0.05)

    def _route_redirect_evil(self):
        self._send(302, headers={"Location": "http://evil.example.com/x.png"})

    def _route_redirect_private(self):
        self._send(302, headers={"Location": "http://169.254.169.254/latest/meta-data"})

    def _route_redirect_ok(self):
        self._send(302, headers={"Location": "/img.png"})

    def _route_loop(self):
        self._send(302, headers={"Location": "/loop"})

    def _route_404(self):
        self._send(404, b"not here")


def _serve(wrap=None):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    if wrap is not None:
        server.socket = wrap(server.socket)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server


@pytest.fixture(scope="module")
def base():
    server = _serve()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


LOCAL = FetchPolicy(allowed_hosts=("127.0.0.1",), allow_private=True, timeout_s=5.0, max_bytes=CAP)


# --- policy checks ---------------------------------------------------------------------------


def test_disabled_by_default(base):
    with pytest.raises(ImageError, match="remote image URLs are disabled on this server; send the image as a base64"):
        fetch_image_bytes(f"{base}/img.png", FetchPolicy())


def test_host_not_in_allowlist(base):
    with pytest.raises(ImageError, match="'127.0.0.1' is not on this server's allowlist"):
        fetch_image_bytes(f"{base}/img.png", FetchPolicy(allowed_hosts=("images.example.com",)))


def test_loopback_refused_even_when_allowlisted(base):
    with pytest.raises(ImageError, match="non-public address"):
        fetch_image_bytes(f"{base}/img.png", FetchPolicy(allowed_hosts=("127.0.0.1",)))


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/a.png", "gopher://127.0.0.1/"])
def test_other_schemes_refused(url):
    with pytest.raises(ImageError, match="scheme .* is not supported"):
        fetch_image_bytes(url, LOCAL)


def test_credentials_in_url_refused(base):
    with pytest.raises(ImageError, match="credentials"):
        fetch_image_bytes(base.replace("http://", "http://user:pw@") + "/img.png", LOCAL)


# --- fetching --------------------------------------------------------------------------------


def test_fetches_png(base):
    data = fetch_image_bytes(f"{base}/img.png", LOCAL)
    assert data == PNG
    assert decode_image(data).size == (20, 10)


@pytest.mark.parametrize("path", ["/huge", "/huge-stream"])
def test_size_cap(base, path):
    with pytest.raises(ImageError, match="larger than the 1.0 MiB limit"):
        fetch_image_bytes(base + path, LOCAL)


def test_truncated_body_refused(base):
    with pytest.raises(ImageError, match="before the whole image"):
        fetch_image_bytes(f"{base}/short", LOCAL)


@pytest.mark.parametrize("path", ["/slow", "/drip-headers", "/drip-body"])
def test_whole_request_deadline(base, path):
    policy = FetchPolicy(allowed_hosts=("127.0.0.1",), allow_private=True, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(ImageError, match="timed out after 0.5 s"):
        fetch_image_bytes(base + path, policy)
    assert time.monotonic() - t0 < 1.5


def test_redirect_hop_rechecked_against_allowlist(base):
    with pytest.raises(ImageError, match="'evil.example.com' is not on this server's allowlist"):
        fetch_image_bytes(f"{base}/redirect-evil", LOCAL)


def test_redirect_hop_rechecked_against_addresses(base, monkeypatch):
    policy = FetchPolicy(allowed_hosts=("127.0.0.1", "169.254.169.254"), allow_private=False)
    with pytest.raises(ImageError, match="non-public"):  # the first hop is already refused ...
        fetch_image_bytes(f"{base}/redirect-private", policy)
    hops = []
    real = fetch._resolve_checked

    def spy(target, policy, deadline):
        hops.append(target.host)
        if target.host == "127.0.0.1":  # ... so let the first hop through and check the second
            return real(target, replace(policy, allow_private=True), deadline)
        return real(target, policy, deadline)

    monkeypatch.setattr(fetch, "_resolve_checked", spy)
    with pytest.raises(ImageError, match="'169.254.169.254' resolves to a private"):
        fetch_image_bytes(f"{base}/redirect-private", policy)
    assert hops == ["127.0.0.1", "169.254.169.254"]


def test_relative_redirect_followed(base):
    assert fetch_image_bytes(f"{base}/redirect-ok", LOCAL) == PNG


def test_redirect_limit(base):
    with pytest.raises(ImageError, match="redirected more than 3 times"):
        fetch_image_bytes(f"{base}/loop", LOCAL)
    with pytest.raises(ImageError, match="redirected more than 0 times"):
        fetch_image_bytes(f"{base}/redirect-ok", replace(LOCAL, max_redirects=0))


def test_not_found(base):
    with pytest.raises(ImageError, match="HTTP 404 Not Found"):
        fetch_image_bytes(f"{base}/missing", LOCAL)


def test_connect_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ImageError, match="could not connect"):
        fetch_image_bytes(f"http://127.0.0.1:{port}/img.png", LOCAL)


def test_pipeline_fetches_remote_images_with_the_stricter_byte_cap(base):
    cfg = VisionConfig(n_layers=1, max_n_token=64, min_pixels=112 * 112)
    part = {"type": "image_url", "image_url": {"url": f"{base}/img.png"}}
    pipe = ImagePipeline(cfg, 1000, 999, fetch=LOCAL)
    prep = pipe.prepare(type("R", (), {"ids": [1, 999], "images": [part], "image_positions": [1]})())
    assert prep.blocks == [(1, 1 + prep.images[0].block.length)]
    small = ImagePipeline(cfg, 1000, 999, fetch=LOCAL, limits=ImageLimits(max_bytes=len(PNG) - 1))
    with pytest.raises(ImageError, match=f"image 1: the remote image is larger than the {len(PNG) - 1} byte limit"):
        small.prepare(type("R", (), {"ids": [999], "images": [part], "image_positions": [0]})())
    with pytest.raises(ImageError, match="image 1: remote image URLs are disabled"):
        ImagePipeline(cfg, 1000, 999).prepare(type("R", (), {"ids": [999], "images": [part], "image_positions": [0]})())


# --- DNS: every address checked, the checked address is the one dialled -----------------------


@pytest.fixture
def fake_dns(monkeypatch, base):
    port = int(base.rsplit(":", 1)[1])
    answers = {"images.test": ["127.0.0.1"], "mixed.test": ["93.184.216.34", "127.0.0.1"]}
    calls: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if host in answers:
            calls.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[host]]
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return port, calls


def test_connects_to_checked_address_with_host_name(fake_dns):
    port, calls = fake_dns
    Handler.hosts.clear()
    policy = FetchPolicy(allowed_hosts=("*.test",), allow_private=True)
    assert fetch_image_bytes(f"http://images.test:{port}/img.png", policy) == PNG
    assert calls == ["images.test"]  # resolved once: no second lookup a rebinding DNS could answer
    assert Handler.hosts == [f"images.test:{port}"]


def test_one_private_address_refuses_the_host(fake_dns):
    port, _ = fake_dns
    for host in ("images.test", "mixed.test"):
        with pytest.raises(ImageError, match="non-public"):
            fetch_image_bytes(f"http://{host}:{port}/img.png", FetchPolicy(allowed_hosts=("*.test",)))


# --- TLS: verified against the host name even though the IP is dialled --------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server = _serve(lambda sock: server_ctx.wrap_socket(sock, server_side=True))
    yield server.server_address[1], ssl.create_default_context(cafile=str(cert))
    server.shutdown()
    server.server_close()


def test_https_verified_against_host_name(tls_server, monkeypatch):
    port, client_ctx = tls_server
    monkeypatch.setattr(fetch, "_ssl_context", lambda: client_ctx)
    policy = FetchPolicy(allowed_hosts=("localhost", "127.0.0.1"), allow_private=True, timeout_s=5.0)
    assert fetch_image_bytes(f"https://localhost:{port}/img.png", policy) == PNG
    with pytest.raises(ImageError, match="TLS certificate .* could not be verified"):
        fetch_image_bytes(f"https://127.0.0.1:{port}/img.png", policy)  # the certificate names localhost only


def test_stalled_tls_handshake_times_out():
    with socket.socket() as listener:  # the kernel accepts the connection; nobody ever answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        policy = FetchPolicy(allowed_hosts=("127.0.0.1",), allow_private=True, timeout_s=0.5)
        with pytest.raises(ImageError, match="timed out after 0.5 s"):
            fetch_image_bytes(f"https://127.0.0.1:{listener.getsockname()[1]}/img.png", policy)


def test_https_to_plain_http_server_fails_cleanly(base):
    with pytest.raises(ImageError, match="TLS handshake"):
        fetch_image_bytes(base.replace("http://", "https://") + "/img.png", LOCAL)


# --- classifiers -----------------------------------------------------------------------------


@pytest.mark.parametrize("address", [
    "10.0.0.1", "192.168.1.1", "172.16.0.1", "127.0.0.1", "169.254.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "224.0.0.1", "255.255.255.255", "240.0.0.1", "::1", "::", "fc00::1", "fe80::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2002:a00:1::", "2001:0:4136:e378:8000:63bf:f5ff:fffe",
    "64:ff9b::a00:1", "fec0::1", "not-an-ip", "",
])
def test_non_public_addresses_refused(address):
    assert not is_public_address(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e"])
def test_public_addresses_allowed(address):
    assert is_public_address(address)


def test_host_patterns():
    patterns = FetchPolicy(allowed_hosts=("*.Example.com", "images.test.", "::1")).allowed_hosts
    assert patterns == ("*.example.com", "images.test", "::1")
    assert host_allowed("a.example.com", patterns) and host_allowed("a.b.example.com", patterns)
    assert not host_allowed("example.com", patterns) and not host_allowed("badexample.com", patterns)
    assert host_allowed("images.test", patterns) and not host_allowed("x.images.test", patterns)
    assert host_allowed("::1", patterns)
    for bad in ("*", "*example.com", "a.*.com", ""):
        with pytest.raises(ValueError):
            FetchPolicy(allowed_hosts=(bad,))
