"""Images at the front door: reading one (a PIL image, a data: URI, a URL on an allowed
host), the model's own Hugging Face processor (resizing, normalizing, expanding each
image placeholder into the model's image tokens), and the `MultiModalFeature`s a
request carries to the scheduler and the model runner.

Every failure is an `InvalidRequestError` naming the field; nothing here touches the
engine's state.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from pagoda.config import RequestLimits
from pagoda.errors import InvalidRequestError
from pagoda.request import MultiModalFeature

FETCH_TIMEOUT_S = 10.0  # the whole fetch, not each read
MAX_ASPECT_RATIO = 50  # a thin strip upscaled to the model's size would take gigabytes
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # never EPS and the like
_DATA_URI = re.compile(r"data:(image/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,", re.IGNORECASE)


def num_image_tokens(vision_config: dict[str, Any]) -> int:
    """A LLaVA image's tokens: one per patch, and the class token's (CLIP's) when the
    projector reads every position ("full")."""
    patches = (vision_config["image_size"] // vision_config["patch_size"]) ** 2
    clip = vision_config.get("model_type", "clip_vision_model") == "clip_vision_model"
    keeps_class = vision_config.get("vision_feature_select_strategy", "default") == "full"
    return patches + (1 if clip and keeps_class else 0)


def _fail(param: str, message: str, where: str | None = None) -> None:
    raise InvalidRequestError(f"{where or param} {message}.", param=param)


def is_remote_url(value: Any) -> bool:
    return isinstance(value, str) and value[:8].lower().startswith(("http://", "https://"))


def _host(url: str, param: str, where: str) -> str:
    try:
        return (urllib.parse.urlsplit(url).hostname or "").lower()
    except ValueError:
        _fail(param, "is not a well-formed URL", where)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead anywhere, past the allowed hosts: none is followed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(newurl, code, "redirects are not followed", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirects)


def allowed_remote_images(messages: Any, limits: RequestLimits) -> list[tuple[dict, str, str, str]]:
    """(the dict holding the URL, its key, URL, where) for each image_url part of a
    conversation whose URL is on an allowed host: what the server fetches off the
    processor thread (so a slow host holds up only its own request). Anything else is
    left to the front door, which refuses other remote URLs without fetching."""
    allowed = {d.lower() for d in limits.allowed_media_domains}
    found = []
    for i, message in enumerate(messages if allowed and isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            value = part.get("image_url")
            holder, key = (value, "url") if isinstance(value, dict) else (part, "image_url")
            url, where = holder.get(key), f"messages[{i}].content[{j}].image_url"
            if is_remote_url(url) and _host(url, "messages", where) in allowed:
                found.append((holder, key, url, where))
    return found


def fetch_image_bytes(url: str, limits: RequestLimits, param: str, where: str) -> bytes:
    """The bytes at `url` if its host is one `limits.allowed_media_domains` names and
    they fit `limits.max_image_bytes`; else a refusal. Takes at most about
    FETCH_TIMEOUT_S; redirects are refused (they could lead past the allowed hosts)."""
    host = _host(url, param, where)
    allowed = limits.allowed_media_domains or ()
    if host not in {d.lower() for d in allowed}:
        hint = (
            f"allowed hosts: {', '.join(allowed)}"
            if allowed
            else "start the engine with --allowed-media-domains to fetch from named hosts"
        )
        _fail(param, f"is a remote URL on {host!r}, which pagoda does not fetch from ({hint}); "
              "send the image as a data: URI", where)  # fmt: skip
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    chunks, size = [], 0
    try:
        with _OPENER.open(url, timeout=FETCH_TIMEOUT_S) as response:
            while size <= limits.max_image_bytes:
                chunk = response.read(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    _fail(param, f"took longer than {FETCH_TIMEOUT_S:.0f} s to fetch", where)
    except (OSError, ValueError, http.client.HTTPException) as e:
        _fail(param, f"could not be fetched: {e}", where)
    if size > limits.max_image_bytes:
        _fail(param, f"is larger than the limit of {limits.max_image_bytes} bytes", where)
    return b"".join(chunks)


def load_image(value: Any, limits: RequestLimits, param: str, where: str):
    """An RGB PIL image from a PIL image, raw bytes, a base64 data: URI or an allowed
    URL; refused when undecodable or larger than the limits."""
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, str):
            match = _DATA_URI.match(value)
            if match is not None:
                encoded = value[match.end() :]
                if len(encoded) * 3 // 4 > limits.max_image_bytes + 3:
                    _fail(
                        param, f"is larger than the limit of {limits.max_image_bytes} bytes", where
                    )
                try:
                    value = base64.b64decode(encoded, validate=True)
                except (binascii.Error, ValueError):
                    _fail(param, "is a data: URI whose base64 payload is malformed", where)
            elif is_remote_url(value):
                value = fetch_image_bytes(value, limits, param, where)
            else:
                _fail(param, "must be a base64 data: URI (data:image/png;base64,...) or an "
                      "http(s) URL", where)  # fmt: skip
        if not isinstance(value, (bytes, bytearray)):
            _fail(
                param,
                f"must be an image (PIL.Image, bytes or a data: URI), not {type(value).__name__}",
                where,
            )
        if len(value) > limits.max_image_bytes:
            _fail(param, f"is larger than the limit of {limits.max_image_bytes} bytes", where)
        try:
            image = Image.open(io.BytesIO(value), formats=IMAGE_FORMATS)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            _fail(param, f"could not be decoded as an image ({type(e).__name__})", where)
    width, height = image.size
    if width < 1 or height < 1 or width * height > limits.max_image_pixels:
        _fail(
            param,
            f"is {width}x{height} pixels; the limit is {limits.max_image_pixels} pixels",
            where,
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        _fail(param, f"is {width}x{height} pixels; the longer side may be at most "
              f"{MAX_ASPECT_RATIO} times the shorter", where)  # fmt: skip
    try:
        return image.convert("RGB")  # decodes the whole file: a truncated one fails here
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        _fail(param, f"could not be decoded as an image ({type(e).__name__})", where)


def image_hash(image) -> str:
    """The image's identity for the encoder cache and the prefix cache: a 128-bit
    BLAKE2b digest of its size and RGB pixels."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class ImageInputProcessor:
    """A vision-language model's Hugging Face processor, behind the front door's checks."""

    def __init__(self, path: str, hf_config: dict[str, Any], limits: RequestLimits) -> None:
        from transformers import AutoProcessor

        try:
            self.hf_processor = AutoProcessor.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - any failure means the folder lacks one
            raise ValueError(f"model {path!r}: cannot load its image processor: {e}") from e
        self.limits = limits
        self.image_token_id = int(hf_config["image_token_id"])
        self.tokens_per_image = num_image_tokens(hf_config["vision_config"])
        tokenizer = getattr(self.hf_processor, "tokenizer", None)
        self.image_token = getattr(self.hf_processor, "image_token", None) or (
            tokenizer.convert_ids_to_tokens(self.image_token_id) if tokenizer else "<image>"
        )

    def check_images(self, images: Any, param: str) -> list:
        """`multi_modal_data["image"]`: one image or a list of them, each loaded."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        if len(images) > self.limits.max_images:
            _fail(param, f"holds {len(images)} images; at most {self.limits.max_images} "
                  "are allowed per prompt (limit_mm_per_prompt)")  # fmt: skip
        return [
            load_image(img, self.limits, param, f"{param}[{i}]") for i, img in enumerate(images)
        ]

    def process(
        self, text: str, images: Sequence, param: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(token ids with each image's placeholder expanded, one feature per image)."""
        num_placeholders = text.count(self.image_token)
        if num_placeholders != len(images):
            _fail(param, f"has {num_placeholders} image placeholder(s) ({self.image_token!r}) "
                  f"but {len(images)} image(s) were given; each image needs one")  # fmt: skip
        if len(images) > self.limits.max_images:
            _fail(param, f"holds {len(images)} images; at most {self.limits.max_images} "
                  "are allowed per prompt (limit_mm_per_prompt)")  # fmt: skip
        if not images:
            ids = self.hf_processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            return ids, []
        try:
            out = self.hf_processor(
                text=text,
                images=list(images),
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
            )
        except Exception as e:  # noqa: BLE001 - the processor's refusal, as the client's error
            _fail(param, f"could not be processed with its images: {e}")
        ids = out["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        per_image, rest = divmod(len(positions), len(images))
        if rest or per_image != self.tokens_per_image:
            _fail(param, f"expanded to {len(positions)} image tokens for {len(images)} images; "
                  f"the model takes {self.tokens_per_image} per image (check the "
                  "placeholders, or the model's processor config)")  # fmt: skip
        features = []
        for k, image in enumerate(images):
            start = positions[k * per_image]
            if positions[(k + 1) * per_image - 1] != start + per_image - 1:
                _fail(param, "has an image placeholder split by other tokens")
            pixel_values = out["pixel_values"][k]
            features.append(MultiModalFeature(image_hash(image), start, per_image, pixel_values))
        return ids, features
