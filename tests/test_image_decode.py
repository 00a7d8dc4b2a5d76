"""Safe decoding of user images: formats, data URLs, limits, corrupt files and decompression bombs."""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import pytest
from PIL import Image

from ds4serve.multimodal.images import (
    ImageError,
    ImageLimits,
    check_request_images,
    decode_image,
    parse_data_url,
    sniff_format,
)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _gradient(size=(40, 30), mode="RGB") -> Image.Image:
    img = Image.new("RGB", size)
    img.putdata([(x * 6 % 256, y * 8 % 256, 100) for y in range(size[1]) for x in range(size[0])])
    return img.convert(mode) if mode != "RGB" else img


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_with_size(width: int, height: int) -> bytes:
    """A valid 1×1 PNG whose IHDR is patched to claim ``width × height`` (CRC fixed up)."""
    data = bytearray(_encode(Image.new("RGB", (1, 1)), "PNG"))
    ihdr = 8  # after the signature: length(4), b"IHDR"(4), 13 data bytes, crc(4)
    assert data[ihdr + 4: ihdr + 8] == b"IHDR"
    data[ihdr + 8: ihdr + 16] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr + 4: ihdr + 21]))
    data[ihdr + 21: ihdr + 25] = struct.pack(">I", crc)
    return bytes(data)


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,kw,exact", [
    ("PNG", {}, True),
    ("WEBP", {"lossless": True}, True),
    ("JPEG", {"quality": 95}, False),
])
def test_round_trip(fmt, kw, exact):
    src = _gradient()
    data = _encode(src, fmt, **kw)
    assert sniff_format(data) == fmt
    img = decode_image(parse_data_url(_data_url(data, f"image/{fmt.lower()}")))
    assert img.mode == "RGB" and img.size == src.size
    if exact:
        assert list(img.getdata()) == list(src.getdata())
    else:
        err = max(abs(a - b) for p, q in zip(img.getdata(), src.getdata()) for a, b in zip(p, q))
        assert err < 40


def test_gif_takes_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in [(255, 0, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    data = buf.getvalue()
    assert sniff_format(data) == "GIF"
    img = decode_image(data)
    assert img.mode == "RGB" and img.size == (16, 16)
    assert img.getpixel((8, 8)) == (255, 0, 0)


def test_rgba_alpha_is_dropped_not_composited():
    src = Image.new("RGBA", (8, 8), (10, 200, 30, 0))  # fully transparent
    img = decode_image(_encode(src, "PNG"))
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (10, 200, 30)


def test_declared_mime_is_ignored():
    data = _encode(_gradient(), "PNG")
    assert decode_image(parse_data_url(_data_url(data, "image/jpeg"))).size == (40, 30)


# --- data URLs ------------------------------------------------------------------------------


def test_bad_base64():
    with pytest.raises(ImageError, match="base64"):
        parse_data_url("data:image/png;base64,iVBOR!!w0KGgo=")
    with pytest.raises(ImageError, match="base64"):
        parse_data_url("data:image/png;base64,iVBO\nRw0KGgo=")  # strict: no line breaks


@pytest.mark.parametrize("url", ["https://example.com/a.png", "http://10.0.0.1/x.jpg"])
def test_remote_urls_need_the_operator(url):
    with pytest.raises(ImageError, match="operator"):
        parse_data_url(url)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/y.png", "just some text"])
def test_other_schemes(url):
    with pytest.raises(ImageError, match="data:image"):
        parse_data_url(url)


@pytest.mark.parametrize("url,match", [
    ("data:image/png;base64,", "empty"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64", "malformed"),
])
def test_malformed_data_urls(url, match):
    with pytest.raises(ImageError, match=match):
        parse_data_url(url)


def test_oversize_is_checked_before_decoding():
    limits = ImageLimits(max_bytes=1000)
    ok = base64.b64encode(b"\0" * 1000).decode()
    assert len(parse_data_url(f"data:image/png;base64,{ok}", limits)) == 1000
    # 4 KB of invalid base64: a size error (not a base64 error) proves no decoding was attempted
    with pytest.raises(ImageError, match="larger than"):
        parse_data_url("data:image/png;base64," + "!" * 4000, limits)


# --- decoding -------------------------------------------------------------------------------


def test_unsupported_formats():
    bmp = _encode(_gradient(), "BMP")
    tiff = _encode(_gradient(), "TIFF")
    for data in (bmp, tiff, b"\x00\x01garbage" * 10, b"RIFF\0\0\0\0WAVEfmt "):
        with pytest.raises(ImageError, match="PNG, JPEG, GIF or WebP"):
            decode_image(data)
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_truncated_file(fmt):
    data = _encode(_gradient((64, 64)), fmt)
    with pytest.raises(ImageError, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2])


def test_corrupt_header():
    data = bytearray(_encode(_gradient(), "PNG"))
    data[20] ^= 0xFF  # break the IHDR CRC/size
    with pytest.raises(ImageError, match="corrupt"):
        decode_image(bytes(data))


def test_oversized_bytes():
    data = _encode(_gradient((64, 64)), "PNG")
    with pytest.raises(ImageError, match="larger than"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))
    assert decode_image(data, ImageLimits(max_bytes=len(data))).size == (64, 64)


@pytest.mark.parametrize("size", [(100_000, 100_000), (2**31 - 1, 2**31 - 1), (10_000, 7_000)])
def test_decompression_bomb(size):
    """Huge claimed dimensions are refused from the header, before any pixel is inflated."""
    data = _png_with_size(*size)
    assert len(data) < 100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(ImageError, match="pixel"):
            decode_image(data)


def test_pixel_limit_is_configurable():
    data = _encode(_gradient((40, 30)), "PNG")
    with pytest.raises(ImageError, match="40x30"):
        decode_image(data, ImageLimits(max_pixels=1199))
    assert decode_image(data, ImageLimits(max_pixels=1200)).size == (40, 30)


def test_request_limits():
    limits = ImageLimits(max_images=2, max_total_bytes=100)
    check_request_images([50, 50], limits)
    with pytest.raises(ImageError, match="at most 2"):
        check_request_images([1, 1, 1], limits)
    with pytest.raises(ImageError, match="per-request"):
        check_request_images([60, 41], limits)


def test_decoded_size_slack_is_checked():
    """Base64 length rounds up to 3-byte groups; the decoded length is checked exactly too."""
    payload = base64.b64encode(b"\0" * 1001).decode()
    with pytest.raises(ImageError, match="larger than"):
        parse_data_url(f"data:image/png;base64,{payload}", ImageLimits(max_bytes=1000))


def test_huge_url_is_refused_cheaply():
    with pytest.raises(ImageError, match="larger than"):
        parse_data_url("data:image/png;base64," + "A" * 2_000_000, ImageLimits(max_bytes=1000))
