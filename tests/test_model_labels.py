"""The labels the product reads: refused at the edges when unusable, read tolerantly from rows already stored."""

from __future__ import annotations

import numpy as np
import pytest

from forecaster.report.history import simulator_models
from forecaster.store.catalog import ServingModelSpec
from forecaster.store.fields import check_labels


@pytest.mark.parametrize(("key", "good", "bad"), [
    ("cold_cost", ["0", "5", " 7.5 ", "1e9"], ["-1", "1e12", "inf", "-inf", "nan", "abc", "", "1,5"]),
    ("request_s", ["0.05", "3600"], ["0", "-2", "nan", "86401", "fast"]),
    ("prometheus_query", ["vector(1)", 'sum(x{m="a"})'], ["", "   ", 'sum(x{m="{model_id}"})']),
    ("prometheus_burst_query", ["vector(1)"], ["", "{model_id}"]),
    ("k8s_kind", ["Deployment", "InferenceService"], ["deployment", "Pod", ""]),
    ("k8s_name", ["llama", "llama-70b.v2", "a" * 253], ["Llama", "-x", "x-", "a_b", "", "a" * 254]),
    ("k8s_namespace", ["serving", "a1-b2"], ["a.b", "Serving", "", "a" * 64]),
])
def test_the_labels_the_product_reads_accept_what_their_reader_can_use(key, good, bad):
    for value in good:
        assert ServingModelSpec(id="m", labels={key: value}).labels == {key: value}
    for value in bad:
        with pytest.raises(ValueError, match=f"^label '{key}' "):
            ServingModelSpec(id="m", labels={"team": "x", key: value})
        with pytest.raises(ValueError, match=f"^label '{key}' "):
            check_labels({key: value})


def test_other_labels_are_free_text():
    assert check_labels({"team": "", "registered_by": "anything", "cold_cost_note": "-1"})


def test_the_report_reads_numeric_labels_stored_as_text_as_the_plan_job_does():
    """``PUT /v1/models`` stores labels as text: the report read ``cold_cost "5"`` and ``request_s "2"`` as no number
    and replayed those models at the default cost and request duration, while the plan job used 5."""
    row = ("m", None, None, None, None, 1, 2.0, None)
    rows = [(*row[:1], *row[1:], {"cold_cost": "5", "request_s": "2"}),
            ("n", *row[1:], {"cold_cost": "abc", "request_s": "-1", "catalog": "bge-large-en-v1.5"}),
            ("o", *row[1:], {"cold_cost": "1e12"}),
            ("p", *row[1:], {"cold_cost": 3.0})]
    table, cold, _ = simulator_models(rows, default_cold_cost=1.0)
    np.testing.assert_array_equal(cold, [5.0, 1.0, 1.0, 3.0])
    assert table.loc["m", "request_s"] == 2.0
    assert table.loc["n", "request_s"] == 0.05  # a bad request_s falls back to the catalogue entry's
