"""The sample image prompts (`include/sample_data/images.jsonl`): small PNGs made here, by hand.

Each image is a PNG written with zlib and struct alone (signature, IHDR, one IDAT of filter-0
RGB scanlines, IEND; the PNG specification's layout), so nothing is downloaded and the bytes are
the same on every machine. The prompts carry them as data URIs in OpenAI `image_url` parts, one
row in ShareGPT's layout with `<image>` markers, so the demo runs every layout through the DAG.

    .venv/bin/python -m eagle3_devtools.sample_images --write   # regenerate the file
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import zlib
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "sample_data" / "images.jsonl"


def png(width: int, height: int, pixel) -> bytes:
    """An RGB PNG whose pixel (x, y) is `pixel(x, y)` -> (r, g, b)."""
    rows = b"".join(b"\0" + bytes(c for x in range(width) for c in pixel(x, y)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


IMAGES = {  # name -> (width, height, pixel): a flag, a gradient, a checkerboard, a bar chart
    "flag": (60, 40, lambda x, y: (200, 16, 46) if y < 20 else (255, 255, 255)),
    "gradient": (96, 32, lambda x, y: (x * 255 // 95, 64, 255 - x * 255 // 95)),
    "checker": (32, 32, lambda x, y: (0, 0, 0) if (x // 8 + y // 8) % 2 else (240, 240, 240)),
    "bars": (80, 60, lambda x, y: (30, 120, 200) if y >= 60 - (10, 35, 20, 50)[min(x // 20, 3)] else (255, 255, 255)),
}


def rows() -> list[dict]:
    """The image prompts: one image, two images with text between, and a ShareGPT row."""
    uri = {name: _uri(png(*spec)) for name, spec in IMAGES.items()}

    def image(name: str) -> dict:
        return {"type": "image_url", "image_url": {"url": uri[name]}}

    def text(t: str) -> dict:
        return {"type": "text", "text": t}

    return [
        {"messages": [{"role": "user", "content": [image("flag"), text("Which countries use a flag like this one?")]}]},
        {
            "messages": [
                {"role": "system", "content": "Answer in one short paragraph."},
                {
                    "role": "user",
                    "content": [text("Describe how the colours change across this image."), image("gradient")],
                },
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        text("Here are two pictures: "),
                        image("checker"),
                        text(" and "),
                        image("bars"),
                        text(". Which one is a chart, and what does it show?"),
                    ],
                }
            ]
        },
        {
            "conversations": [{"from": "human", "value": "<image>\nCount the squares in this board."}],
            "images": [uri["checker"]],
        },
    ]


def text() -> str:
    return "".join(json.dumps(r) + "\n" for r in rows())


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m eagle3_devtools.sample_images --write")
    OUT.write_text(text())
    print(f"wrote {OUT}")
