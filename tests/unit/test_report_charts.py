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


def test_policy_histograms_share_their_bins_and_hold_every_sample():
    """The policy check's per-path histograms: drawn on the same edges (so a shifted path shows
    as shifted bars, not relabelled axes), each sample counted once, in the bar whose range holds
    it (checked by walking the bars, not by the binning the code uses)."""
    from eagle3_data.report.render import logprob_histograms

    means = {"local": [-1.0, -1.2, -0.95, -1.1], "overflow": [-3.1, -2.0, -2.45]}
    figs = logprob_histograms(means)
    assert [f["caption"].split(":")[0] for f in figs] == ["local", "overflow"]
    edges = [[(b["lo"], b["hi"]) for b in f["chart"]["bars"]] for f in figs]
    assert edges[0] == edges[1]
    lo, hi = edges[0][0][0], edges[0][-1][1]
    assert lo <= -3.1 and hi >= -0.95
    for f, side in zip(figs, means):
        bars = f["chart"]["bars"]
        for v in means[side]:
            holding = [b for b in bars if b["lo"] <= v < b["hi"] or (b is bars[-1] and v == b["hi"])]
            assert len(holding) == 1 and holding[0]["n"] >= 1, (side, v)
        assert sum(b["n"] for b in bars) == len(means[side])
    assert logprob_histograms({"local": [], "overflow": []}) == []


def test_every_row_histograms_draw_the_extractions_own_bins():
    """The run page's per-path histograms from the extraction's summary (LogprobStats, its
    producer): every sample in the bar whose range holds its mean, bars only where samples are,
    one chart per path."""
    import torch

    from eagle3_data.report.render import every_row_histograms
    from eagle3_data.target_head.logprobs import LogprobStats

    means = {"vllm": [-0.4, -2.5, -2.7], "openrouter": [-7.2, -25.0]}  # -25: below the first edge (-20)
    stats = LogprobStats()
    for source, ms in means.items():
        for i, m in enumerate(ms):
            stats.add(f"{source}-{i}", torch.tensor([float("nan"), m, m]), [0, 1, 1], source)
    figs = every_row_histograms(stats.summary())
    assert [f["caption"] for f in figs] == ["openrouter: 2 samples", "vllm: 3 samples"]
    for f, source in zip(figs, ("openrouter", "vllm")):
        bars = f["chart"]["bars"]
        assert bars[0]["n"] and bars[-1]["n"]  # empty bins at the ends left out
        for m in means[source]:
            assert [b for b in bars if b["lo"] <= m < b["hi"]] and sum(b["n"] for b in bars) == len(means[source]), (
                source,
                m,
            )
    assert every_row_histograms(None) == [] and every_row_histograms({"sources": {}}) == []
