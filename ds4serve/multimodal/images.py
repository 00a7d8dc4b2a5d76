"""Safe decoding of user-supplied images (spec ds4-vision §2.3, §6.2).

Images arrive from untrusted clients, so every step is bounded *before* it costs memory:

- ``data:`` URLs are size-checked on the encoded text before base64 decoding, and decoded strictly
  (no silently skipped garbage characters).
- The format is detected from the bytes (the declared MIME type is ignored, as the DeepSeek API
  does) and only PNG, JPEG, GIF and WebP are handed to Pillow, each to its own plugin only, so a
  crafted file cannot reach one of Pillow's rarer decoders.
- The pixel count is read from the header and refused before any pixel is decoded, which is what
  stops decompression bombs (a few KB of PNG that inflate to gigabytes).
- Any decoder failure becomes an :class:`ImageError` whose message says what the user can fix;
  the server turns it into a 400 instead of a 500.

Remote ``http(s)`` URLs are deliberately not fetched here: that needs an SSRF-safe fetcher which
an operator has to enable explicitly.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

__all__ = [
    "SUPPORTED_FORMATS",
    "ImageError",
    "ImageLimits",
    "parse_data_url",
    "sniff_format",
    "decode_image",
    "check_request_images",
]

SUPPORTED_FORMATS = ("PNG", "JPEG", "GIF", "WEBP")
_SUPPORTED_TEXT = "PNG, JPEG, GIF or WebP"
_MAX_HEADER = 1024  # generous bound on "data:image/...;...;base64," before the payload

_DATA_URL = re.compile(
    r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)$", re.S | re.I)


class ImageError(ValueError):
    """A user image cannot be accepted; the message tells the user what to change."""


@dataclass(frozen=True)
class ImageLimits:
    """Operator limits on user images (defaults follow lucebox: 16 MiB/image, 32 MiB/request, 64 MP)."""

    max_bytes: int = 16 * 2**20  # encoded bytes of one image
    max_pixels: int = 64_000_000  # decoded width × height of one image
    max_images: int = 16  # images in one request
    max_total_bytes: int = 32 * 2**20  # encoded bytes of all images of one request


DEFAULT_LIMITS = ImageLimits()


def _mib(n: int) -> str:
    """Human-readable size for error messages."""
    return f"{n / 2**20:.1f} MiB"


def _too_large(max_bytes: int) -> ImageError:
    """The error for an image over the per-image byte limit."""
    return ImageError(f"image is larger than the {_mib(max_bytes)} limit; send a smaller or more "
                      "compressed image")


def _max_encoded_len(max_bytes: int) -> int:
    """Longest base64 text that can decode to at most ``max_bytes`` bytes (4 chars per 3 bytes)."""
    return 4 * -(-max_bytes // 3)


def parse_data_url(url: str, limits: ImageLimits | None = None) -> bytes:
    """Return the bytes of a ``data:image/<fmt>;base64,<payload>`` URL, or raise ImageError.

    The encoded length is checked first: decoding a 1 GB string just to learn that it is too big
    would already be the denial of service the limit exists to prevent.
    """
    limits = limits or DEFAULT_LIMITS
    scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ImageError(
            "remote image URLs (http/https) are not enabled on this server; send the image inline "
            "as a data:image/...;base64,... URL, or ask the operator to enable remote fetching")
    if scheme != "data":
        raise ImageError(
            f"unsupported image URL {'scheme ' + repr(scheme) if scheme else repr(url[:16])}; "
            "send the image inline as a data:image/<format>;base64,<payload> URL")
    if len(url) > _max_encoded_len(limits.max_bytes) + _MAX_HEADER:
        raise _too_large(limits.max_bytes)  # before the regex copies or scans a huge string
    match = _DATA_URL.match(url.strip())
    if match is None:
        raise ImageError("malformed data URL; expected data:image/<format>;base64,<payload>")
    mime, params = match["mime"].strip().lower(), match["params"].lower().split(";")[1:]
    if not mime.startswith("image/"):
        raise ImageError(f"data URL media type {mime or '(empty)'!r} is not an image; use image/png, "
                         "image/jpeg, image/gif or image/webp")
    if "base64" not in (p.strip() for p in params):
        raise ImageError("image data URLs must be base64-encoded (data:image/<format>;base64,...)")
    return _decode_base64(match["payload"], limits.max_bytes)


def _decode_base64(payload: str, max_bytes: int) -> bytes:
    """Strict base64 decoding with the size check on the encoded text."""
    if not payload:
        raise ImageError("the image data URL has an empty payload")
    if len(payload) > _max_encoded_len(max_bytes):
        raise _too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"image data URL payload is not valid base64 ({exc}); encode the raw file "
                         "bytes with standard base64, without line breaks") from None
    if not data:
        raise ImageError("the image data URL has an empty payload")
    if len(data) > max_bytes:  # the encoded check above allows up to 2 bytes of slack
        raise _too_large(max_bytes)
    return data


def sniff_format(data: bytes) -> str | None:
    """Pillow format name from the magic bytes, or None when it is not a supported format."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _check_pixels(size: tuple[int, int], max_pixels: int) -> None:
    """Refuse images whose header promises too many pixels (checked before decoding them)."""
    width, height = size
    if width < 1 or height < 1:
        raise ImageError(f"image has an empty size {width}x{height}; send a valid image")
    if width * height > max_pixels:
        raise ImageError(
            f"image is {width}x{height} = {width * height:,} pixels, more than the "
            f"{max_pixels:,} pixel limit; downscale it before sending")


def _open_checked(data: bytes, fmt: str, max_pixels: int) -> Image.Image:
    """Parse the header only (Pillow is lazy), check the size, then decode the first frame."""
    try:
        img = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError:
        raise ImageError(f"image has too many pixels (more than the {max_pixels:,} pixel limit); "
                         "downscale it before sending") from None
    _check_pixels(img.size, max_pixels)
    img.seek(0)  # animated GIF/WebP: the first frame is the image
    return img.convert("RGB")  # decodes; alpha is dropped, not composited (reference behaviour)


def decode_image(data: bytes, limits: ImageLimits | None = None) -> Image.Image:
    """Decode untrusted image bytes into an RGB Pillow image, or raise ImageError.

    Only PNG, JPEG, GIF (first frame) and WebP (first frame) are accepted; the format is detected
    from the bytes. Truncated or corrupt files raise ImageError, never a Pillow exception.
    """
    limits = limits or DEFAULT_LIMITS
    if not data:
        raise ImageError("image is empty; send the image file's bytes")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {_mib(len(data))}, larger than the {_mib(limits.max_bytes)} "
                         "limit; send a smaller or more compressed image")
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageError(f"unsupported or unrecognised image format; send {_SUPPORTED_TEXT}")
    try:
        return _open_checked(data, fmt, limits.max_pixels)
    except ImageError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # any decoder failure on untrusted bytes is the user's file, not us
        raise ImageError(f"could not decode the {fmt} image ({_describe(exc)}); the file may be "
                         "truncated or corrupt, re-export it and try again") from None


def _describe(exc: Exception) -> str:
    """Short decoder error text for the user (Pillow's "cannot identify" names a BytesIO object)."""
    if isinstance(exc, UnidentifiedImageError):
        return "not a readable image file"
    return f"{type(exc).__name__}: {exc}"


def check_request_images(sizes: Sequence[int], limits: ImageLimits | None = None) -> None:
    """Per-request limits: number of images and total encoded bytes (checked before decoding)."""
    limits = limits or DEFAULT_LIMITS
    if len(sizes) > limits.max_images:
        raise ImageError(f"request has {len(sizes)} images; at most {limits.max_images} are "
                         "allowed per request")
    total = sum(sizes)
    if total > limits.max_total_bytes:
        raise ImageError(f"request images total {_mib(total)}, more than the "
                         f"{_mib(limits.max_total_bytes)} per-request limit; send fewer or smaller "
                         "images")
