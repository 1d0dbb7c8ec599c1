"""Which samples the policy check scores, and the ids it scores them on."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from eagle3_data.chat_format import OutputFormat
from eagle3_data.images import parse_refs
from eagle3_data.nucleus import Item


def has_images(row: Mapping[str, Any]) -> bool:
    """Whether a generation row answers an image prompt. Such rows are scored with their images
    when the local engines take images (`generation.local.images`), else left out of the check:
    scored over ids alone, the target would score an answer about an image it is not shown, and
    image prompts then all take the overflow path: the answers' lower log-probabilities would
    count against that path, an honest provider's included."""
    return bool(parse_refs(row.get("images")))


def _images(row: Mapping[str, Any]) -> str | None:
    return row.get("images") if has_images(row) else None


def pick(sample_ids: Iterable[str], n: int, seed: int) -> list[str]:
    """`n` of `sample_ids`, the same ones every run (ordered by a hash of the seed and the id:
    not the input order, which may group samples by topic or length)."""
    key = lambda s: hashlib.sha256(f"{seed}:{s}".encode()).digest()  # noqa: E731
    return sorted(sorted(set(sample_ids), key=key)[:n])


@dataclass(frozen=True)
class Selection:
    """Which rows a side gives the check: up to `n` of its own route (sampled answers) and up to
    `pairs` calibration rows (route "both"), picked by `seed`; image prompts' rows only
    `with_images` (`has_images`)."""

    n: int
    seed: int
    pairs: int = 0
    with_images: bool = False


def _chosen(
    rows: Iterable[Mapping[str, Any]], routes: Mapping[str, str], side_route: str, sel: Selection
) -> list[Mapping[str, Any]]:
    """Up to `sel.n` rows of the side's own route (sampled answers) and up to `sel.pairs`
    calibration rows (route "both": greedy, compared as pairs, never in the sampled pool). `pick`'s
    order makes a larger `n` a superset of a smaller one: a pilot's samples stay in the sample it
    grows into."""
    usable = [
        r
        for r in rows
        if r.get("status") == "ok"
        and r.get("output_ids")
        and r.get("prompt_ids")
        and (sel.with_images or not has_images(r))
    ]
    keep: set[str] = set()
    for route, k in ((side_route, sel.n), ("both", sel.pairs)):
        keep.update(pick((r["sample_id"] for r in usable if routes.get(r["sample_id"]) == route), k, sel.seed))
    return [r for r in usable if r["sample_id"] in keep]


def overflow_items(rows: Iterable[Mapping[str, Any]], routes: Mapping[str, str], sel: Selection) -> list[Item]:
    """The reconstruct stage's rows: their output ids are what reconstruction made of the text."""
    return [
        Item(
            r["sample_id"],
            "overflow",
            routes[r["sample_id"]],
            tuple(r["prompt_ids"]) + tuple(r["output_ids"]),
            len(r["prompt_ids"]),
            _images(r),
        )
        for r in _chosen(rows, routes, "overflow", sel)
    ]


def local_items(
    fmt: OutputFormat, rows: Iterable[Mapping[str, Any]], routes: Mapping[str, str], sel: Selection, vocab_size: int
) -> list[Item]:
    """The local stage's rows, on the ids the overflow path would have given their text (the
    validator's rebuild); a row without one (a wrong stop, text that cannot determine the ids)
    is left out."""
    import pyarrow as pa

    from eagle3_data.mismatch import InputRow, Validator, detect_stop_convention, rows_from_batches

    chosen = _chosen(rows, routes, "local", sel)
    if not chosen:
        return []
    columns = ("sample_id", "output_ids", "finish_reason", "provenance", "tools", "messages")
    table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in chosen])
    parsed = list(rows_from_batches(table.to_batches(), vocab_size))
    inputs = [p for p in parsed if isinstance(p, InputRow)]
    rebuilt = Validator(fmt, detect_stop_convention(fmt, inputs)).rebuilds(inputs)
    by_id = {r["sample_id"]: r for r in chosen}
    return [
        Item(
            p.sample_id,
            "local",
            routes[p.sample_id],
            tuple(by_id[p.sample_id]["prompt_ids"]) + tuple(ids),
            len(by_id[p.sample_id]["prompt_ids"]),
            _images(by_id[p.sample_id]),
        )
        for p, ids in zip(inputs, rebuilt)
        if ids
    ]
