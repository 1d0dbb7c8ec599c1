"""Which samples the policy check scores (stages/policy/select.py): sampled pools without the greedy
calibration answers, the calibration pairs on their own count, a pilot contained in the sample
it grows into."""

from __future__ import annotations

from eagle3_data.stages.policy.select import Selection, overflow_items


def rows(n: int) -> tuple[list[dict], dict[str, str]]:
    out, routes = [], {}
    for i in range(n):
        sid = f"s{i:03d}"
        routes[sid] = "both" if i % 5 == 0 else "overflow"
        out.append({"sample_id": sid, "status": "ok", "prompt_ids": [1, 2], "output_ids": [3, i]})
    return out, routes


def test_sampled_pool_holds_no_calibration_answer_and_pairs_are_counted_apart():
    data, routes = rows(100)
    items = overflow_items(data, routes, Selection(10, seed=3, pairs=4))
    sampled = [it for it in items if it.route == "overflow"]
    assert len(sampled) == 10 and len([it for it in items if it.route == "both"]) == 4
    assert all(routes[it.sample_id] == "overflow" for it in sampled)
    assert [it for it in overflow_items(data, routes, Selection(10, seed=3)) if it.route == "both"] == []


def test_a_pilot_is_part_of_the_sample_it_grows_into():
    data, routes = rows(200)
    pilot = {it.sample_id for it in overflow_items(data, routes, Selection(8, seed=1))}
    grown = {it.sample_id for it in overflow_items(data, routes, Selection(50, seed=1))}
    assert len(pilot) == 8 and len(grown) == 50 and pilot < grown


def test_image_prompts_are_scored_only_where_the_engines_take_images():
    """Without `with_images` (the engines take no images) the scoring request would carry ids
    only: an answer about an image the target is not shown would score low on whichever path
    answered it (then always overflow), an honest provider's too. With it, image rows are chosen
    as text rows are and carry their references for the request."""
    data, routes = rows(60)
    ref = '[{"sha256": "ab", "uri": "s3://b/x.png"}]'
    data = [{**r, "images": ref if i % 2 else None} for i, r in enumerate(data)]
    items = overflow_items(data, routes, Selection(60, seed=3, pairs=60))
    assert items and all(int(it.sample_id[1:]) % 2 == 0 for it in items)
    assert len(items) == 30  # every text row, sampled and calibration alike
    assert all(it.images is None for it in items)
    every = overflow_items(data, routes, Selection(60, seed=3, pairs=60, with_images=True))
    assert len(every) == 60
    assert {it.sample_id for it in every if it.images == ref} == {r["sample_id"] for r in data if r["images"]}
