"""The report's bar charts leave room for their labels: each label is drawn right-aligned at
`label_w - 8`, so a column narrower than the label cut its start off ("unreconstructable" showed
as "nreconstructable"). The width a label needs is taken at 7 px per character, a 12 px
sans-serif's wide average; the browser screenshot test is the check in a real renderer."""

from __future__ import annotations

CHAR_PX = 7.0


def test_every_class_label_fits_its_column():
    from eagle3_data.report.data import classes
    from eagle3_data.report.render import _class_bars, _threshold_bars

    counts = {c: i + 1 for i, c in enumerate(classes())}
    assert "unreconstructable" in counts
    bars = _class_bars(counts, sum(counts.values()))
    rates = _threshold_bars({"rates": {c: 0.01 for c in counts}, "thresholds": {"max_bpe_mismatch_rate": 0.1}})
    for chart in (bars, rates):
        for row in chart["rows"]:
            assert chart["label_w"] - 8 >= CHAR_PX * len(row["label"]), (row["label"], chart["label_w"])
        assert chart["width"] - chart["label_w"] >= 300  # the bars keep their room
