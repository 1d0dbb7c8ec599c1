"""Images of image prompts: read once, checked, stored content-addressed, counted in media tokens.

A prompt's image part (`{"type": "image_url", "image_url": {"url": ...}}`, the url a data URI, an
`s3://` object or a path relative to the prompt file) is read once by the prompts stage, refused
when it is missing, over `limits.max_image_bytes` or not a decodable PNG/JPEG/WebP/GIF, and stored
in the run's bucket under its sha256 (`{prefix}/images/sha256/{hex}`). From then on the prompt's
part names that object and the row carries a reference per image, in prompt order (the `images`
column, canonical JSON):

    {"uri": "s3://<bucket>/<key>", "sha256": "<hex>", "bytes": int, "width": int, "height": int,
     "media_tokens": int}

`media_tokens` is how many image-placeholder ids (the format's `media_pad`) the model sees for the
image: Kimi-K2.5's processor resizes it under a patch budget (navit_resize), pads it to whole
2x2 groups of 14-pixel patches and merges each group into one token. The chat template renders
one placeholder per image; the prompt ids expand it (`expand_media`). transformers'
Kimi_K25ImageProcessor is the reference for the count (tests compare against its own arithmetic);
docs/images.md says what each consumer gets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

IMAGE_PART_TYPES = ("image_url",)
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
# Kimi-K2.5's media_proc_cfg (preprocessor_config.json), transformers' Kimi_K25ImageProcessor defaults
PATCH_SIZE = 14
MERGE_SIZE = 2
MAX_PATCHES = 16384  # in_patch_limit
MAX_PATCHES_PER_SIDE = 512  # patch_limit_on_one_side (size.max_height)


class ImageError(Exception):
    """An image that cannot be used, naming it (its uri, or where it came from) and why."""


def media_tokens(width: int, height: int) -> int:
    """Placeholder tokens of a width x height image: transformers' navit_resize (scale down,
    never up, under the total and per-side patch budgets; pad to whole merge groups), then one
    token per MERGE_SIZE x MERGE_SIZE patches."""
    patches_h, patches_w = max(1.0, height // PATCH_SIZE), max(1.0, width // PATCH_SIZE)
    side = MAX_PATCHES_PER_SIDE * PATCH_SIZE
    scale = min(1.0, math.sqrt(MAX_PATCHES / (patches_h * patches_w)), side / height, side / width)
    new_h, new_w = min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side)
    factor = MERGE_SIZE * PATCH_SIZE
    pad_h, pad_w = new_h + (factor - new_h % factor) % factor, new_w + (factor - new_w % factor) % factor
    return (pad_h // PATCH_SIZE) * (pad_w // PATCH_SIZE) // MERGE_SIZE**2


def probe(data: bytes) -> tuple[str, int, int]:
    """(mime type, width, height) of an encoded image, decoded whole so a truncated or corrupt
    file is refused here and not by an engine days later."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, by name
            with Image.open(io.BytesIO(data)) as img:
                kind, (width, height) = img.format, img.size
                limit = Image.MAX_IMAGE_PIXELS  # None when a caller turned Pillow's check off
                if limit is not None and width * height > limit:  # a few compressed bytes can decode to gigabytes
                    raise ImageError(f"{width}x{height} pixels, over Pillow's decompression-bomb limit of {limit}")
                img.load()
    except ImageError:
        raise
    except Exception as exc:  # PIL raises many kinds (OSError, SyntaxError, DecompressionBombError, ...)
        raise ImageError(f"not a decodable image ({type(exc).__name__}: {str(exc)[:120]})") from None
    if kind not in FORMATS:
        raise ImageError(f"{kind} images are not accepted (accepted: {', '.join(FORMATS)})")
    return FORMATS[kind], width, height


def image_key(prefix: str, sha256: str) -> str:
    return "/".join(p for p in (prefix, "images", "sha256", sha256) if p)


@dataclass
class ImageSink:
    """Where the prompts stage puts images: the run's ArtifactStore (its bucket and prefix; None:
    check only, as `eagle3-data prompts upload` does before uploading), the size limit, and what
    it read this load (source -> reference: each image read once)."""

    store: Any
    max_bytes: int
    seen: dict[str, dict[str, Any]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"images_stored": 0, "image_bytes_stored": 0})

    def add(self, url: str, base: str, client) -> dict[str, Any]:
        """The reference of the image at `url` (relative paths against the prompt file `base`),
        stored in the bucket once; ImageError says why it cannot be used."""
        source = url if url.startswith(("data:", "s3://")) else _join(base, url)
        key = "data:sha256:" + hashlib.sha256(url.encode()).hexdigest() if url.startswith("data:") else source
        if key not in self.seen:  # a data URI is known by its hash: the load does not hold every image's text
            self.seen[key] = self._store(_read_source(source, client, self.max_bytes))
        return self.seen[key]

    def _store(self, data: bytes) -> dict[str, Any]:
        mime, width, height = probe(data)
        digest = hashlib.sha256(data).hexdigest()
        if self.store is None:
            return {
                "uri": None,
                "sha256": digest,
                "bytes": len(data),
                "width": width,
                "height": height,
                "media_tokens": media_tokens(width, height),
            }
        key = image_key(self.store.prefix, digest)
        if not any(o["Key"] == key for o in self.store.list_objects(key)):
            self.store.put_object(key, data, content_type=mime)
            self.counts["images_stored"] += 1
            self.counts["image_bytes_stored"] += len(data)
        return {
            "uri": f"s3://{self.store.bucket}/{key}",
            "sha256": digest,
            "bytes": len(data),
            "width": width,
            "height": height,
            "media_tokens": media_tokens(width, height),
        }


def _join(base: str, rel: str) -> str:
    """A path relative to the prompt file `base` (a local path or an s3:// URI)."""
    if rel.startswith("/") or "\\" in rel:
        raise ImageError(f"{rel!r}: expected a data URI, an s3:// URI or a path relative to the prompt file")
    folder = base.rsplit("/", 1)[0] if "/" in base else "."
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"{rel!r}: a relative path may not leave the prompt file's folder")
    return "/".join([folder, *parts])


def _read_source(source: str, client, max_bytes: int) -> bytes:
    """The bytes of a data URI, an s3:// object or a local file, the size checked before reading."""
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError("a data URI must be data:<mime>;base64,<data>")
        if len(payload) * 3 // 4 > max_bytes + 3:
            raise ImageError(
                f"about {len(payload) * 3 // 4} bytes, over the limit of {max_bytes} (limits.max_image_bytes)"
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("a data URI whose data is not valid base64") from None
    elif source.startswith("s3://"):
        data = _read_s3(source, client, max_bytes)
    else:
        from pathlib import Path

        path = Path(source)
        if not path.is_file():
            raise ImageError(f"{source}: no such file")
        if path.stat().st_size > max_bytes:
            raise ImageError(
                f"{source}: {path.stat().st_size} bytes, over the limit of {max_bytes} (limits.max_image_bytes)"
            )
        data = path.read_bytes()
    if len(data) > max_bytes:
        raise ImageError(f"{len(data)} bytes, over the limit of {max_bytes} (limits.max_image_bytes)")
    return data


def _read_s3(uri: str, client, max_bytes: int | None = None) -> bytes:
    from botocore.exceptions import ClientError

    from eagle3_data.storage.client import NO_BUCKET, NOT_FOUND, error_code

    bucket, _, key = uri[len("s3://") :].partition("/")
    if client is None:
        raise ImageError(f"{uri}: an s3:// image needs an S3 client")
    try:
        obj = client.get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        code = error_code(exc)
        raise ImageError(f"{uri}: {'no such object' if code in NOT_FOUND or code == NO_BUCKET else code}") from None
    size = obj.get("ContentLength")
    if max_bytes is not None and size is not None and size > max_bytes:
        obj["Body"].close()
        raise ImageError(f"{uri}: {size} bytes, over the limit of {max_bytes} (limits.max_image_bytes)")
    return obj["Body"].read()


def read_image(store, ref: dict[str, Any]) -> bytes:
    """The stored bytes of one image reference, verified against its recorded size and sha256
    (`store`: anything with the S3 `client`, e.g. an ArtifactStore)."""
    uri = ref.get("uri", "?")
    data = _read_s3(uri, store.client)
    if len(data) != ref.get("bytes") or hashlib.sha256(data).hexdigest() != ref.get("sha256"):
        raise ImageError(
            f"{uri}: {len(data)} bytes with sha256 {hashlib.sha256(data).hexdigest()[:16]}..., "
            f"the reference records {ref.get('bytes')} bytes and {str(ref.get('sha256'))[:16]}..."
        )
    return data


def data_uri(data: bytes) -> str:
    """An image as a data URI (what OpenAI-compatible providers accept in `image_url`)."""
    mime, _, _ = probe(data)
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(message index, part index, part) of every image part, in prompt order."""
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    yield i, j, part


def parse_refs(images: str | list[Any] | None) -> list[dict[str, Any]]:
    """The `images` column (canonical JSON, null or empty for text rows) as a list."""
    if not images:
        return []
    return json.loads(images) if isinstance(images, str) else list(images)


def refs_for(messages: list[dict[str, Any]], refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The references of the images in `messages`, a prefix of the conversation `refs` belong to."""
    return refs[: sum(1 for _ in image_parts(messages))]


def expand_media(ids: list[int], refs: list[dict[str, Any]], pad_id: int) -> list[int]:
    """Prompt ids with the i-th placeholder id repeated refs[i]["media_tokens"] times: what the
    model sees. The template renders one pad per image part; a different count is an error."""
    if not refs:
        return ids
    at = [k for k, t in enumerate(ids) if t == pad_id]
    if len(at) != len(refs):
        raise ImageError(f"the prompt renders {len(at)} image placeholder(s) for {len(refs)} image(s)")
    out, start = [], 0
    for k, ref in zip(at, refs):
        out += ids[start:k] + [pad_id] * int(ref["media_tokens"])
        start = k + 1
    return out + ids[start:]


def collapse_runs(ids: Sequence[int], token: int) -> list[int]:
    """`ids` with every run of `token` cut to one: what the engines take beside the images (vLLM's
    Kimi-K2.5 processor and SGLang's each expand one placeholder per image themselves)."""
    return [t for i, t in enumerate(ids) if not (t == token and i and ids[i - 1] == token)]


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first position where two id sequences differ (the shorter one's length if one is a
    prefix of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def media_mask(ids: list[int], pad_id: int) -> list[bool]:
    """Which ids are image placeholders (never trained on)."""
    return [t == pad_id for t in ids]


# -- beside the merged shards -------------------------------------------------------------------
# JSON Lines, not Parquet: every reader of a merge folder takes its `*.parquet` files for shards
MERGED_IMAGES_FILE = "images.jsonl"


def merged_images(store, inputs) -> tuple[bytes, dict[str, Any]] | None:
    """The image references of every ok input sample that has images, as `MERGED_IMAGES_FILE`
    beside the merged shards (one `{"sample_id", "images"}` a line, by sample_id: their rows join
    on it), and its counts; None when no sample has an image (a text merge is as it always was).
    Media tokens are prompt ids, which the merge masks (loss_mask 0): never trained on."""
    from eagle3_data.schemas import schema_for

    found: dict[str, str] = {}
    for ref in inputs:
        written = store.read_manifest(ref)["schema"]
        if "images" not in schema_for(written["name"], written["version"]).names:
            continue  # a stage written before images existed (generations v1, v2): text only
        for batch in store.iter_batches(ref, columns=["sample_id", "status", "images"]):
            for sid, status, images in zip(*(batch.column(c).to_pylist() for c in ("sample_id", "status", "images"))):
                if status == "ok" and images:
                    found.setdefault(sid, images)
    if not found:
        return None
    refs = {sid: parse_refs(found[sid]) for sid in sorted(found)}
    text = "".join(json.dumps({"sample_id": sid, "images": r}, sort_keys=True) + "\n" for sid, r in refs.items())
    return text.encode(), {
        "samples": len(refs),
        "images": sum(map(len, refs.values())),
        "media_tokens": sum(r["media_tokens"] for rs in refs.values() for r in rs),
    }


def read_merged_images(store, ref) -> dict[str, list[dict[str, Any]]]:
    """sample_id -> image references of a committed merge stage (empty for a text merge)."""
    data = store.read_object(ref, MERGED_IMAGES_FILE)
    return {} if data is None else image_index(data)


def image_index(source: bytes | str | Any) -> dict[str, list[dict[str, Any]]]:
    """sample_id -> image references of a `MERGED_IMAGES_FILE` (its bytes or its path)."""
    if not isinstance(source, bytes):
        from pathlib import Path

        source = Path(source).read_bytes()
    lines = (json.loads(line) for line in source.decode().splitlines() if line.strip())
    return {e["sample_id"]: e["images"] for e in lines}


LEFT_OUT_FILE = "left_out.jsonl"
NO_IMAGES_IN_FORMAT = "image sample: SpecForge's offline format holds no images"
