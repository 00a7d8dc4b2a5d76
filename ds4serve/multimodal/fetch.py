"""SSRF-safe fetching of remote ``http(s)`` image URLs (spec ds4-vision §6.2).

A server that fetches URLs chosen by its clients can be turned into a proxy into its own network
(cloud metadata endpoints, admin consoles on loopback, the cluster's private ranges). Remote images
are therefore *off* unless the operator lists the hosts that may be fetched, and even an allowed host
is refused when any of its addresses is not a public one. The defences, and why each is needed:

- **Allowlist first**: an empty allowlist disables the feature; otherwise only exact host names or
  ``*.example.com`` suffix patterns are fetched.
- **Every resolved address is checked** (private, loopback, link-local, multicast, reserved, shared
  address space, and IPv4 addresses embedded in IPv6 forms such as ``::ffff:a.b.c.d``, 6to4, Teredo
  and NAT64): one bad address out of several refuses the host, since the system may try any of them.
- **The socket connects to the checked IP itself**: resolving again inside ``http.client`` would let
  a DNS-rebinding attacker answer "public" for the check and "127.0.0.1" for the connection. The
  request still says ``Host: <name>`` and TLS is verified against the name (SNI/``server_hostname``).
- **Every redirect hop goes through all the checks again** (scheme, allowlist, addresses), at most
  ``max_redirects`` times: a public host redirecting to ``http://169.254.169.254/`` is the classic
  bypass.
- **Bounded cost**: a ``Content-Length`` above the cap is refused before reading, the body is read in
  chunks and abandoned as soon as it passes the cap, and a whole-request deadline (enforced by a
  watchdog that shuts the socket down) stops slow-drip servers that would otherwise pass every
  per-read timeout and hold a preprocessing worker forever.

Only the standard library is used, so the checks are all in this file and easy to audit. Error
messages say what the *user* can change and never echo the addresses a host resolved to (that
would leak the server's internal DNS view).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from http import HTTPStatus
from typing import NamedTuple
from urllib.parse import urljoin, urlsplit

from .images import ImageError

__all__ = ["FetchPolicy", "fetch_image_bytes", "host_allowed", "is_public_address"]

log = logging.getLogger("ds4serve.multimodal")

_SCHEMES = {"http": 80, "https": 443}
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024
_USER_AGENT = "ds4serve-image-fetch/1"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known prefix: the low 32 bits are an IPv4 address
_DISABLED = ("remote image URLs are disabled on this server; send the image as a base64 data: URL "
             "(data:image/png;base64,...)")

_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class FetchPolicy:
    """Operator policy for remote images; the default (empty allowlist) disables them.

    ``allowed_hosts`` holds exact host names (or IP literals) and ``*.example.com`` patterns, which
    match any name *below* ``example.com`` but not ``example.com`` itself. ``timeout_s`` bounds the
    whole fetch, redirects included. ``allow_private`` lifts the address check and exists for tests
    against a local server only.
    """

    allowed_hosts: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_bytes: int = 16 * 2**20
    max_redirects: int = 3
    allow_private: bool = False

    def __post_init__(self) -> None:
        """Normalise the patterns once and refuse settings that would make the checks meaningless."""
        if not self.timeout_s > 0:
            raise ValueError(f"FetchPolicy.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_bytes < 1 or self.max_redirects < 0:
            raise ValueError(f"FetchPolicy needs max_bytes >= 1 and max_redirects >= 0, got "
                             f"{self.max_bytes} and {self.max_redirects}")
        object.__setattr__(self, "allowed_hosts", tuple(_normalise_pattern(p) for p in self.allowed_hosts))

    @property
    def enabled(self) -> bool:
        """Remote URLs are fetched only when the operator named at least one host."""
        return bool(self.allowed_hosts)


# --- host and address checks ----------------------------------------------------------------


def _normalise_pattern(pattern: str) -> str:
    """Lower-case an allowlist entry; only a leading ``*.`` wildcard is meaningful.

    A bare ``*`` or a wildcard elsewhere is refused rather than guessed at: an allowlist that
    silently matches more than the operator meant is exactly the hole it is there to close.
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"allowed host patterns must be non-empty strings, got {pattern!r}")
    wildcard = pattern.strip().startswith("*.")
    name = pattern.strip()[2:] if wildcard else pattern.strip()
    if "*" in name or not name.strip("."):
        raise ValueError(f"bad allowed host pattern {pattern!r}; use 'images.example.com' or '*.example.com'")
    return ("*." if wildcard else "") + _normalise_host(name, ValueError)


def _normalise_host(host: str, error: type[Exception] = ImageError) -> str:
    """Canonical comparable form: lower case, no trailing dot, IDNA A-labels, compressed IP literals."""
    host = host.strip().rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if host.isascii():
        return host
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise error(f"image URL host {host!r} is not a valid host name") from None


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``host`` (already normalised) matches an exact entry or a ``*.suffix`` pattern."""
    for pattern in patterns:
        if pattern.startswith("*."):
            suffix = pattern[1:]  # ".example.com": at least one label must precede it
            if host.endswith(suffix) and len(host) > len(suffix):
                return True
        elif host == pattern:
            return True
    return False


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address tunnels to: a route to them is a route into IPv4 space."""
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
    if ip.teredo is not None:
        found.extend(ip.teredo)  # (server, client)
    if ip in _NAT64:
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def _is_global(ip: _IPAddress) -> bool:
    """One address, every ``ipaddress`` category: ``is_global`` alone lets multicast through."""
    bad = (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
           or ip.is_unspecified or getattr(ip, "is_site_local", False))
    return ip.is_global and not bad


def is_public_address(address: str | _IPAddress) -> bool:
    """True only for a globally routable unicast address (IPv4 embedded in IPv6 checked as well).

    Unparseable input is not public: the classifier must fail closed.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if not _is_global(ip):
        return False
    return ip.version == 4 or all(_is_global(v4) for v4 in _embedded_ipv4(ip))


# --- URL parsing ----------------------------------------------------------------------------


class _Target(NamedTuple):
    """One checked hop: where to connect and what to ask for."""

    scheme: str
    host: str
    port: int
    path: str


def _check_url(url: str, policy: FetchPolicy) -> _Target:
    """Scheme, credentials, host and allowlist checks for one hop (no network access)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise ImageError("the image URL is malformed; check it, or send the image as a base64 data: URL") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ImageError(f"image URL scheme {scheme or '(none)'!r} is not supported; use an https:// URL "
                         "or a base64 data: URL")
    if not policy.enabled:
        raise ImageError(_DISABLED)
    if parts.username is not None or parts.password is not None:
        raise ImageError("image URLs must not contain credentials (user:password@); use a public URL")
    if not parts.hostname:
        raise ImageError("the image URL has no host name")
    host = _normalise_host(parts.hostname)
    if not host_allowed(host, policy.allowed_hosts):
        raise ImageError(f"image host {host!r} is not on this server's allowlist for remote images; send the "
                         "image as a base64 data: URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(scheme, host, port or _SCHEMES[scheme], path)


# --- deadline, resolution -------------------------------------------------------------------


class _Deadline:
    """The whole-request time budget; every blocking step takes its timeout from what is left."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, or the timeout ImageError when the budget is spent."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise self.error()
        return left

    def error(self) -> ImageError:
        """The user-facing timeout message (the same whichever step ran out of time)."""
        return ImageError(f"fetching the image URL timed out after {self.seconds:g} s; use a faster host or "
                          "send the image as a base64 data: URL")


def _getaddrinfo(host: str, port: int, deadline: _Deadline) -> list[tuple]:
    """``getaddrinfo`` bounded by the deadline (it has no timeout of its own, so it runs in a thread).

    A resolver that hangs leaves one daemon thread behind until the system resolver gives up, which
    is better than a preprocessing worker blocked for that long.
    """
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as exc:
            box["error"] = exc

    thread = threading.Thread(target=work, name="ds4serve-image-dns", daemon=True)
    thread.start()
    thread.join(deadline.remaining())
    if thread.is_alive():
        raise deadline.error()
    if "error" in box:
        raise ImageError(f"could not resolve the image URL host {host!r}; check the URL")
    return box["infos"]  # type: ignore[return-value]


def _resolve_checked(target: _Target, policy: FetchPolicy, deadline: _Deadline) -> list[tuple]:
    """Resolve once and return ``(family, sockaddr)`` pairs, all of them verified public.

    The connection later uses exactly these sockaddrs, so the address that was checked is the
    address that is contacted (no second lookup for a rebinding attacker to answer differently).
    """
    infos = _getaddrinfo(target.host, target.port, deadline)
    addrs = [(family, sockaddr) for family, _type, _proto, _name, sockaddr in infos
             if family in (socket.AF_INET, socket.AF_INET6)]
    if not addrs:
        raise ImageError(f"the image URL host {target.host!r} has no usable address")
    if not policy.allow_private and not all(is_public_address(sockaddr[0]) for _f, sockaddr in addrs):
        raise ImageError(f"the image URL host {target.host!r} resolves to a private or otherwise non-public "
                         "address; only public hosts can be fetched, or send the image as a base64 data: URL")
    return addrs


# --- connections ----------------------------------------------------------------------------


class _Watchdog:
    """Shuts the socket down when the deadline passes, whatever ``http.client`` is blocked in.

    Per-operation socket timeouts cannot bound a server that sends one header byte per second;
    shutting the file descriptor down from a timer thread can. ``socket.socket.shutdown`` is called
    unbound so that a TLS socket's Python-level state is not touched from the timer thread.
    """

    def __init__(self, deadline: _Deadline):
        self.fired = threading.Event()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(max(0.0, deadline.at - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        """Point the watchdog at the current socket (the TLS wrapper replaces the raw one)."""
        self._sock = sock
        if self.fired.is_set():
            self._fire()

    def _fire(self) -> None:
        self.fired.set()
        sock = self._sock
        if sock is not None:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to a host *name* over a socket connected to one pre-checked IP address."""

    def __init__(self, host: str, port: int, addr: tuple, timeout: float, watchdog: _Watchdog):
        super().__init__(host, port, timeout=timeout)
        self._family, self._sockaddr = addr
        self._watchdog = watchdog
        self.pinned: socket.socket | None = None  # survives http.client handing the socket to the response

    def connect(self) -> None:
        raw = socket.socket(self._family, socket.SOCK_STREAM)
        self._watchdog.watch(raw)
        try:
            raw.settimeout(self.timeout)
            raw.connect(self._sockaddr)
            sock = self._secure(raw)
        except BaseException:
            raw.close()
            raise
        self.sock = self.pinned = sock

    def _secure(self, sock: socket.socket) -> socket.socket:
        return sock


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    """The same, with TLS verified against the host name (SNI), not the IP that was dialled."""

    default_port = 443  # so the Host header omits ":443"

    def _secure(self, sock: socket.socket) -> socket.socket:
        """Handshake only after the watchdog follows the TLS socket, so a stalled handshake is bounded too."""
        tls = _ssl_context().wrap_socket(sock, server_hostname=self.host, do_handshake_on_connect=False)
        self._watchdog.watch(tls)  # wrap_socket detached ``sock``; its shutdown would no longer reach the fd
        try:
            tls.do_handshake()
        except BaseException:
            tls.close()
            raise
        return tls


@lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """System CAs, hostname checking on; built once because loading the CA bundle is slow."""
    return ssl.create_default_context()


def _error_for(exc: BaseException, host: str) -> ImageError:
    """Translate a network failure into a message the user can act on."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ImageError(f"the TLS certificate of image host {host!r} could not be verified")
    if isinstance(exc, ssl.SSLError):
        return ImageError(f"the TLS handshake with image host {host!r} failed")
    if isinstance(exc, http.client.HTTPException):
        return ImageError(f"image host {host!r} sent an invalid HTTP response")
    return ImageError(f"could not connect to image host {host!r}; check that the URL is publicly reachable")


# --- one hop ----------------------------------------------------------------------------------


def _open(target: _Target, addrs: list[tuple], policy: FetchPolicy, deadline: _Deadline,
          watchdog: _Watchdog) -> _PinnedHTTPConnection:
    """Connect to the first checked address that answers (as ``create_connection`` would)."""
    cls = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    last: BaseException | None = None
    for addr in addrs:
        conn = cls(target.host, target.port, addr, min(policy.timeout_s, deadline.remaining()), watchdog)
        try:
            conn.connect()
            return conn
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if isinstance(exc, TimeoutError) or watchdog.fired.is_set():
                raise deadline.error() from None
            last = exc
    raise _error_for(last, target.host)  # type: ignore[arg-type]


def _read_body(resp: http.client.HTTPResponse, conn: _PinnedHTTPConnection, policy: FetchPolicy,
               deadline: _Deadline, watchdog: _Watchdog) -> bytes:
    """Read at most ``max_bytes``; stop as soon as the body proves larger.

    An empty read means end of body *or* a socket the watchdog shut down, so the watchdog is asked
    before a body is accepted: otherwise a deadline hit mid-body would return a truncated image.
    """
    if resp.length is not None and resp.length > policy.max_bytes:
        raise _too_big(policy.max_bytes)
    body = bytearray()
    while True:
        conn.pinned.settimeout(min(policy.timeout_s, deadline.remaining()))  # type: ignore[union-attr]
        chunk = resp.read1(_CHUNK)
        if not chunk:
            break
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_big(policy.max_bytes)
    if watchdog.fired.is_set():
        raise deadline.error()
    if resp.length:  # http.client returns b"" on a short Content-Length body instead of raising
        raise ImageError("the image host closed the connection before the whole image was received")
    return bytes(body)


def _too_big(max_bytes: int) -> ImageError:
    """Size-cap refusal; small caps are shown in bytes so the limit never reads "0.0 MiB"."""
    limit = f"{max_bytes / 2**20:.1f} MiB" if max_bytes >= 2**20 else f"{max_bytes:,} byte"
    return ImageError(f"the remote image is larger than the {limit} limit; use a smaller image")


def _request(target: _Target, addrs: list[tuple], policy: FetchPolicy,
             deadline: _Deadline) -> tuple[int, str | None, bytes]:
    """One GET: ``(status, Location, body)``; the body is read only for a 200."""
    watchdog = _Watchdog(deadline)
    conn: _PinnedHTTPConnection | None = None
    resp: http.client.HTTPResponse | None = None
    try:
        conn = _open(target, addrs, policy, deadline, watchdog)
        conn.request("GET", target.path, headers={
            "User-Agent": _USER_AGENT, "Accept": "image/*", "Accept-Encoding": "identity", "Connection": "close"})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, resp.getheader("Location"), b""
        return 200, None, _read_body(resp, conn, policy, deadline, watchdog)
    except ImageError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:  # ValueError: I/O on a shut-down socket
        if isinstance(exc, TimeoutError) or watchdog.fired.is_set():
            raise deadline.error() from None
        raise _error_for(exc, target.host) from None
    finally:
        watchdog.cancel()
        _close(conn, resp)


def _close(conn: _PinnedHTTPConnection | None, resp: http.client.HTTPResponse | None) -> None:
    """Release the response, the connection and the pinned socket (which outlives ``conn.sock``)."""
    if resp is not None:
        resp.close()
    if conn is not None:
        if conn.pinned is not None:
            conn.pinned.close()
        conn.close()


def _status_error(status: int) -> ImageError:
    """Non-200 answers; the server's own reason phrase is untrusted text and is not echoed."""
    try:
        phrase = f" {HTTPStatus(status).phrase}"
    except ValueError:
        phrase = ""
    return ImageError(f"the image URL returned HTTP {status}{phrase}; check that the URL is correct and "
                      "publicly reachable")


def fetch_image_bytes(url: str, policy: FetchPolicy) -> bytes:
    """Download an image from an ``http(s)`` URL under ``policy``, or raise ImageError.

    Redirects are followed at most ``policy.max_redirects`` times, each hop re-checked from
    scratch; the deadline covers DNS, connects, TLS, headers and body of all hops together.
    """
    deadline = _Deadline(policy.timeout_s)
    for hop in range(policy.max_redirects + 1):
        target = _check_url(url, policy)
        addrs = _resolve_checked(target, policy, deadline)
        log.debug("fetching image from %s://%s:%d (hop %d)", target.scheme, target.host, target.port, hop)
        status, location, body = _request(target, addrs, policy, deadline)
        if status == 200:
            return body
        if status not in _REDIRECTS:
            raise _status_error(status)
        if not location:
            raise ImageError(f"the image URL answered HTTP {status} without a Location to redirect to")
        url = urljoin(url, location)
    raise ImageError(f"the image URL redirected more than {policy.max_redirects} times; send the final URL "
                     "or a base64 data: URL")
