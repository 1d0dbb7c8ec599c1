"""Images in requests, as the engines take them: OpenRouter's `image_url` parts and SGLang's
`image_data`, each a base64 data URI (this server fetches no URL)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from eagle3_data.images import ImageError, expand_media, media_tokens, probe


def media_pad_id(tok: Any) -> int:
    """The id of the image placeholder of the tokenizer's family (its format's `media_pad`)."""
    from eagle3_data.chat_format import find_output_format

    fmt_cls = find_output_format(tok)
    if fmt_cls is None or fmt_cls.media_pad is None:
        raise ValueError(f"the served model ({fmt_cls.name if fmt_cls else 'no known format'}) takes no images")
    pad_id: int = tok.convert_tokens_to_ids(fmt_cls.media_pad)
    return pad_id


def image_inputs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The images of a chat request's `image_url` parts, as OpenRouter takes them: each part's
    `image_url.url` a base64 data URI of an image (this server fetches no https URL); a malformed
    part is the client's error (ValueError naming it). Returns {"media_tokens"} per image, in order."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}].image_url"
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else None
            if not isinstance(url, str):
                raise ValueError(f"{where}: expected an object with a string `url`")
            if url.startswith(("http://", "https://")):
                raise ValueError(f"{where}.url: the dev server does not fetch image URLs: send a data URI")
            out.append({"media_tokens": media_tokens(*_data_uri_size(url, f"{where}.url"))})
    return out


def _data_uri_size(url: Any, where: str) -> tuple[int, int]:
    """(width, height) of an image sent as a base64 data URI, the only form this server takes
    (it fetches no URL or path); ValueError naming `where` otherwise."""
    head, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ValueError(f"{where}: expected data:image/<type>;base64,<data> (the dev server takes data URIs only)")
    try:
        _, width, height = probe(base64.b64decode(data, validate=True))
    except (binascii.Error, ImageError) as exc:
        raise ValueError(f"{where}: not a readable image ({exc})") from None
    return width, height


def with_images(prompts: list[list[int]], image_data: Any, tok: Any, drift: int) -> tuple[list[int], int]:
    """One `/generate` prompt with its `image_data` as SGLang's Kimi-K2.5 processor takes them
    (srt/multimodal/processors/kimi_k25.py): exactly one placeholder (the format's `media_pad`) per image, each expanded
    here to the image's media tokens (+ `drift`: a server whose processor counts otherwise). An
    image is a base64 data URI (SGLang also takes URLs and paths; this server fetches none).
    Returns the expanded ids and their image tokens (SGLang's `meta_info.image_tokens`)."""
    if len(prompts) != 1:
        raise ValueError("the dev server takes image_data with a single prompt")
    images = image_data if isinstance(image_data, list) else [image_data]
    pad = media_pad_id(tok)
    found = sum(1 for t in prompts[0] if t == pad)
    if found != len(images):
        raise ValueError(
            f"Kimi image placeholders must map one-to-one to image data: expected {len(images)}, found {found} token(s)"
        )
    refs = []
    for k, url in enumerate(images):
        refs.append({"media_tokens": media_tokens(*_data_uri_size(url, f"image_data[{k}]")) + drift})
    return expand_media(list(prompts[0]), refs, pad), sum(r["media_tokens"] for r in refs)


def without_image_data(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part's data left out (the template renders a placeholder for
    it; the data would only bloat the render cache's keys)."""
    return [
        {
            **m,
            "content": [
                {"type": "image_url"} if isinstance(p, dict) and p.get("type") == "image_url" else p
                for p in m["content"]
            ],
        }
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]
