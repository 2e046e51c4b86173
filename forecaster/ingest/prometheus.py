"""Per-step invocation counts of serving models, read from a Prometheus server.

:class:`PrometheusSource` asks a real Prometheus (``GET /api/v1/query_range``)
for one PromQL expression per model and turns the answer into the *raw* frame
and coverage windows that :func:`forecaster.ingest.validate.build_count_batch`
takes::

    source = PrometheusSource("http://prometheus:9090", DEFAULT_QUERY_TEMPLATE)
    raw, windows = source.fetch(["llama-3-8b"], start, end)
    batch = build_count_batch(raw, source="prometheus", step_seconds=60, now=now, windows=windows)

Semantics
---------
The query must give, evaluated at time ``t``, the number of requests of the
model in the step ``[t - step, t)``. The value Prometheus returns at ``t`` is
therefore recorded for the step starting at ``t - step``; to cover
``[start, end)`` the source evaluates at ``start + step, ..., end``.

Values are rounded to the nearest integer (halves to even) and negative values
are clipped to 0, for templates and overrides that are not exact counts:
``increase()`` extrapolates to the edges of its window, so ``sum(increase(c[1m]))``
is rarely a whole number (and ``delta()`` of a counter that was reset can be
negative). The default query counts exactly (:func:`exact_count_query`). NaN and infinite values are not rounded away:
they raise :class:`PrometheusQueryError`.

Coverage is honest: a step for which Prometheus returned no sample (scrape
gap, Prometheus down, the series does not exist (yet)) is unknown, never zero.
The batch contract allows one window per model, so a model's window is its
*first contiguous run* of sampled steps: ``[first sampled step, first gap
after it)``. Without a leading gap that is ``[start, first gap)``; steps after
the gap are reported as not covered, and the caller asks for them again later.
A leading gap is skipped rather than returned as "no window", so that a caller
resuming from the end of the last window moves past a gap that will never fill
(a Prometheus outage last night). A model with no sample at all gets no window
and no rows. Evaluation times later than the local clock are not asked for
(Prometheus would extrapolate from the last scrape into the future).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np
import pandas as pd

__all__ = [
    "DEFAULT_QUERY_TEMPLATE",
    "PROMETHEUS_MAX_POINTS",
    "TRANSIENT_QUERY_ERROR_TYPES",
    "PrometheusError",
    "PrometheusQueryError",
    "PrometheusSource",
    "PrometheusUnavailable",
    "escape_promql_string",
    "exact_count_query",
]

def exact_count_query(counter: str, window: str = "1m") -> str:
    """PromQL counting, at ``t``, the increments of ``counter`` scraped in the window before ``t``: exactly.

    ``sum(increase(c[1m]))`` is not a count. It sees only the rise between samples inside one window, so what a
    counter rose between the last scrape of one minute and the first of the next falls in neither minute, and it
    extrapolates the rest to the window's edges (by about ``60 / (60 - scrape interval)``). For a busy model the two
    errors cancel on average; for a model with one request in a minute, rounding undoes the extrapolation, and a
    request scraped across a minute boundary is lost: with a 15 s scrape a quarter of a sparse model's requests,
    exactly the minutes whose ``p_any`` the planner needs.

    Per series this takes the last sample of the window (``L1``) minus the last sample of the window before
    (``L0``): the windows tile time, so the minutes add up to the counter's rise, every increment counted once, in
    the window of the scrape that first showed it. Three cases:

    * the series has a sample in both windows and did not fall: ``L1 - L0``;
    * it fell (the process restarted, the counter started again at 0): ``L1`` plus what it rose above ``L0``
      before the restart (``max_over_time - L0``, when positive);
    * it has no sample in the window before (a new pod, or the first minute after a scrape gap): its rise inside
      this window, ``L1 - min_over_time``. What a new series already held at its first scrape is not counted,
      because a series back from a long scrape gap looks the same and would count its whole lifetime.

    A series without a sample in the window gives nothing; a model none of whose series has one gives no sample,
    so the minute stays unknown (never 0), as with ``increase()``.

    Args:
        counter: the counter's selector as a template: literal braces doubled, ``{model_id}`` placeholder
            (``vllm:request_success_total{{model_name="{model_id}"}}``). Also works filled in.
        window: the step as a PromQL duration (``1m`` for the 60 s step).
    """
    last = f"last_over_time({counter}[{window}])"
    before = f"last_over_time({counter}[{window}] offset {window})"
    peak = f"max_over_time({counter}[{window}])"
    first = f"min_over_time({counter}[{window}])"
    return (
        f"sum(({last} - {before}) >= 0"
        f" or (({last} + clamp_min({peak} - {before}, 0)) and {before})"
        f" or (({last} - {first}) unless {before}))"
    )


#: Requests of a vLLM model in the minute ending at the evaluation time, counted exactly
#: (:func:`exact_count_query`). Literal braces of the PromQL label matcher are doubled because the template is
#: filled with :meth:`str.format`; ``{model_id}`` is the placeholder. ``forecaster.settings`` repeats it as the
#: default of ``PREWARM_PROMETHEUS_QUERY_TEMPLATE`` (settings sit below this module).
DEFAULT_QUERY_TEMPLATE = exact_count_query('vllm:request_success_total{{model_name="{model_id}"}}')

#: An example for ``PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE``: at ``t``, the most requests of any 10-second
#: bucket of the minute before ``t`` (the burst factor's peak, :mod:`forecaster.contracts.bursts`). It needs a
#: scrape interval of 5 s or less, so that ``increase()`` over 10 s has two samples. The 10-second windows do not
#: overlap, so requests counted between the last scrape of one window and the first of the next fall in neither:
#: with a scrape interval ``s``, a burst counted in one scrape is missed with probability about ``s / 10`` (the
#: minute's count, from the default query, still has it; the burst factor is smoothed over many minutes).
#:
#: The subquery range is ``59s``, not ``1m``: its evaluation times are multiples of 10 s, so at a minute boundary
#: ``t`` it evaluates the buckets ending at ``t - 50, ..., t``, the six buckets of ``[t - 60, t)``. Prometheus 2.x
#: closes ranges on the left, so ``[1m:10s]`` also evaluates at ``t - 60``: the last bucket of the minute before,
#: whose burst then becomes the peak of both minutes. Prometheus 3.x opens ranges on the left, where ``[1m:10s]``
#: and ``[59s:10s]`` give the same six buckets; ``[50s:10s]`` would drop the first bucket there.
EXAMPLE_BURST_QUERY_TEMPLATE = (
    'max_over_time(sum(increase(vllm:request_success_total{{model_name="{model_id}"}}[10s]))[59s:10s])'
)

#: Prometheus refuses range queries of more than 11,000 points per series.
PROMETHEUS_MAX_POINTS = 11_000

_MAX_EXACT = 2.0**53  # larger floats are not exact integers

RAW_COLUMNS = ("unique_id", "ds", "y", "row", "field")
WINDOW_COLUMNS = ("unique_id", "start", "end")


class PrometheusError(Exception):
    """Base class of the errors raised by :class:`PrometheusSource`."""


class PrometheusUnavailable(PrometheusError):
    """Prometheus could not answer now (connection refused, timeout, HTTP 5xx,
    an answer that is not Prometheus JSON). Temporary: retry later."""


#: Prometheus ``errorType`` values of a rejected query that may pass another time: ``execution`` covers "query
#: processing would load too many samples" (it depends on the range asked and on the server's limits) as well as
#: many-to-many matching, which the error type alone cannot tell apart.
TRANSIENT_QUERY_ERROR_TYPES = frozenset({"execution"})


class PrometheusQueryError(PrometheusError):
    """Prometheus answered, but one model's query cannot give counts (bad PromQL,
    more than one series, NaN/Inf values, an execution error). It concerns that
    model's query only: :meth:`PrometheusSource.fetch` can report it per model
    (``errors``) and go on with the others.

    Attributes:
        model_id: the model whose query failed.
        query: the PromQL expression sent.
        error_type: Prometheus' ``errorType`` (``bad_data``, ``execution``) or
            this module's own reason (``multiple_series``, ``nan``, ``infinite``,
            ``too_large``, ``bad_response``).
    """

    def __init__(self, message: str, *, model_id: str, query: str, error_type: str) -> None:
        self.model_id = model_id
        self.query = query
        self.error_type = error_type
        super().__init__(message)

    @property
    def permanent(self) -> bool:
        """True when asking again cannot help until the query (template or override) is fixed; False for
        :data:`TRANSIENT_QUERY_ERROR_TYPES`, which may pass on a later run."""
        return self.error_type not in TRANSIENT_QUERY_ERROR_TYPES


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_promql_string(value: str) -> str:
    """Escape ``value`` for the inside of a double-quoted PromQL string literal.

    Backslashes and double quotes are escaped, and so are control characters
    (a raw newline ends a PromQL string with an error), so that a model id can
    never break out of ``model_name="..."``.
    """
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _as_utc(value: datetime, name: str) -> pd.Timestamp:
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    ts = pd.Timestamp(value)
    return ts.tz_localize("UTC") if ts.tzinfo is None else ts.tz_convert("UTC")


def _empty_raw() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "unique_id": pd.Series([], dtype=object),
            "ds": pd.Series([], dtype="datetime64[ns, UTC]"),
            "y": pd.Series([], dtype="int64"),
            "row": pd.Series([], dtype="int64"),
            "field": pd.Series([], dtype=object),
        }
    )


def _empty_windows() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "unique_id": pd.Series([], dtype=object),
            "start": pd.Series([], dtype="datetime64[ns, UTC]"),
            "end": pd.Series([], dtype="datetime64[ns, UTC]"),
        }
    )


class PrometheusSource:
    """Reads per-step request counts of serving models from Prometheus.

    Args:
        base_url: Prometheus' root URL (``http://prometheus:9090``; a path
            prefix such as ``http://host/prometheus`` is kept).
        query_template: PromQL giving, at evaluation time ``t``, the number of
            requests of one model in ``[t - step, t)``; must yield a single
            series (aggregate with ``sum(...)``). It is filled with
            :meth:`str.format` with the keyword ``model_id``, so literal braces
            of label matchers are written doubled (``{{`` and ``}}``) and the
            placeholder as ``{model_id}``. The model id is escaped for a
            double-quoted PromQL string (:func:`escape_promql_string`); put the
            placeholder inside ``"..."`` (not single quotes or backticks). See
            :data:`DEFAULT_QUERY_TEMPLATE`.
        timeout_s: timeout of each HTTP request.
        max_points_per_query: at most this many evaluation times per
            ``query_range`` call; longer ranges are split into several calls.
            At most 11,000 (Prometheus' own limit).
        client: an ``httpx.Client`` to use (connection pooling, auth, TLS,
            event hooks); its own base URL and timeout are not used. If not
            given, one is created and closed by :meth:`close`.
        step_seconds: width of one step; 60 (one minute) in production. Tests
            use a few seconds against a live server. ``start`` and ``end`` of
            :meth:`fetch` must be aligned to it (multiples since the epoch).
    """

    def __init__(
        self,
        base_url: str,
        query_template: str = DEFAULT_QUERY_TEMPLATE,
        *,
        timeout_s: float = 10.0,
        max_points_per_query: int = 10_000,
        client: httpx.Client | None = None,
        step_seconds: int = 60,
    ) -> None:
        if not base_url:
            raise ValueError("base_url is empty")
        if isinstance(step_seconds, bool) or not isinstance(step_seconds, int) or step_seconds <= 0:
            raise ValueError(f"step_seconds must be a positive integer, got {step_seconds!r}")
        if not 1 <= max_points_per_query <= PROMETHEUS_MAX_POINTS:
            raise ValueError(
                f"max_points_per_query must be between 1 and {PROMETHEUS_MAX_POINTS}, got {max_points_per_query}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        # Fail now, not per model, when the template does not format.
        self._format(query_template, "probe")
        self.base_url = base_url.rstrip("/")
        self.query_template = query_template
        self.timeout_s = float(timeout_s)
        self.max_points_per_query = int(max_points_per_query)
        self.step_seconds = step_seconds
        self._own_client = client is None
        self._client = client if client is not None else httpx.Client()

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP client if this source created it."""
        if self._own_client:
            self._client.close()

    def __enter__(self) -> PrometheusSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries ----------------------------------------------------------

    @staticmethod
    def _format(template: str, model_id: str) -> str:
        try:
            return template.format(model_id=escape_promql_string(model_id))
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"query template {template!r} does not format with str.format(model_id=...): {exc!r}; "
                "write literal braces as '{{' and '}}' and the placeholder as '{model_id}'"
            ) from exc

    def query_for(self, model_id: str, query_overrides: dict[str, str] | None = None) -> str:
        """The PromQL expression sent for ``model_id``.

        An entry of ``query_overrides`` is the complete expression for that
        model, used as is (not a template: no placeholder, no brace doubling).
        """
        if query_overrides and model_id in query_overrides:
            return query_overrides[model_id]
        return self._format(self.query_template, model_id)

    def fetch(
        self,
        model_ids: list[str],
        start: datetime,
        end: datetime,
        *,
        query_overrides: dict[str, str] | None = None,
        errors: dict[str, PrometheusQueryError] | None = None,
    ) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Counts per step of each model in ``[start, end)`` and what they cover.

        Args:
            model_ids: the models to ask for (one query per model; duplicates
                are asked once).
            start, end: the range, aligned to ``step_seconds``; naive datetimes
                are UTC. ``start == end`` asks for nothing.
            query_overrides: per model, a complete PromQL expression replacing
                the template (see :meth:`query_for`); ids not in ``model_ids``
                are ignored.
            errors: when given, a model whose query raises
                :class:`PrometheusQueryError` gets neither rows nor a window,
                its error is stored here under its id, and the other models are
                still asked; without it the first such error is raised.

        Evaluation times after the local clock are not asked for, so a range
        reaching into the future is covered at most up to now (floored to the
        step); pass an ``end`` a scrape interval or two behind now to avoid
        counting a last step whose final scrape Prometheus has not stored yet.

        Returns:
            ``(raw, windows)`` for :func:`~forecaster.ingest.validate.build_count_batch`:
            ``raw`` has ``unique_id``, ``ds`` (step start, UTC), ``y`` (int64
            >= 0, zeros included), ``row`` (1-based position in ``raw``) and
            ``field`` (``"value"``, Prometheus' sample value); ``windows`` has
            one row ``unique_id, start, end`` per model that has a sample, its
            first contiguous run of sampled steps (see the module docstring).
            Models without any sample have neither rows nor a window.

        Raises:
            ValueError: ``start``/``end`` not aligned to the step, ``end < start``,
                or an empty model id.
            PrometheusUnavailable: connection error, timeout, HTTP error status.
            PrometheusQueryError: Prometheus rejected a query, or it returned
                more than one series, or a NaN/infinite value (only without
                ``errors``).
        """
        step = self.step_seconds
        start_ts = _as_utc(start, "start")
        end_ts = _as_utc(end, "end")
        step_ns = step * 1_000_000_000
        for name, ts in (("start", start_ts), ("end", end_ts)):
            if ts.value % step_ns:
                raise ValueError(f"{name} {ts.isoformat()} is not aligned to the {step} s step")
        if end_ts < start_ts:
            raise ValueError(f"end {end_ts.isoformat()} is before start {start_ts.isoformat()}")

        start_s = start_ts.value // 1_000_000_000
        end_s = end_ts.value // 1_000_000_000
        # Never evaluate after the local clock: Prometheus would extrapolate the
        # last scrape into steps that have not happened yet.
        now_s = int(datetime.now(timezone.utc).timestamp())
        last_eval = min(end_s, now_s - now_s % step)
        n_points = max(0, (last_eval - start_s) // step)

        ids = list(dict.fromkeys(model_ids))
        for model_id in ids:
            if not isinstance(model_id, str) or not model_id.strip():
                raise ValueError(f"model ids must be non-empty strings, got {model_id!r}")
        raw_parts: list[pd.DataFrame] = []
        window_rows: list[tuple[str, pd.Timestamp, pd.Timestamp]] = []
        for model_id in ids:
            if n_points == 0:
                break
            query = self.query_for(model_id, query_overrides)
            try:
                samples = self._fetch_model(model_id, query, start_s, n_points)
            except PrometheusQueryError as exc:
                if errors is None:
                    raise
                errors[model_id] = exc
                continue
            covered = self._first_run(samples, start_s, n_points)
            if covered is None:
                continue
            first, count = covered
            # Step k (0-based) starts at start_s + k*step and is the sample at its end.
            ks = np.arange(first, first + count)
            values = np.array([samples[start_s + (k + 1) * step] for k in ks], dtype="float64")
            y = np.clip(np.rint(values), 0, None).astype("int64")
            ds = pd.to_datetime((start_s + ks * step) * 1_000_000_000, utc=True)
            raw_parts.append(pd.DataFrame({"unique_id": model_id, "ds": ds, "y": y}))
            window_rows.append(
                (
                    model_id,
                    pd.Timestamp((start_s + first * step) * 1_000_000_000, tz="UTC"),
                    pd.Timestamp((start_s + (first + count) * step) * 1_000_000_000, tz="UTC"),
                )
            )

        if not raw_parts:
            return _empty_raw(), _empty_windows()
        raw = pd.concat(raw_parts, ignore_index=True)
        raw["unique_id"] = raw["unique_id"].astype(object)
        raw["row"] = np.arange(1, len(raw) + 1, dtype="int64")
        raw["field"] = "value"
        windows = pd.DataFrame(window_rows, columns=list(WINDOW_COLUMNS))
        windows["unique_id"] = windows["unique_id"].astype(object)
        for col in ("start", "end"):
            windows[col] = pd.to_datetime(windows[col], utc=True).astype("datetime64[ns, UTC]")
        raw["ds"] = raw["ds"].astype("datetime64[ns, UTC]")
        return raw[list(RAW_COLUMNS)], windows

    def _first_run(self, samples: dict[int, float], start_s: int, n_points: int) -> tuple[int, int] | None:
        """(first step index, number of steps) of the first run of sampled steps, or None."""
        step = self.step_seconds
        first = next((k for k in range(n_points) if start_s + (k + 1) * step in samples), None)
        if first is None:
            return None
        k = first
        while k < n_points and start_s + (k + 1) * step in samples:
            k += 1
        return first, k - first

    def _fetch_model(self, model_id: str, query: str, start_s: int, n_points: int) -> dict[int, float]:
        """Samples of ``query`` at ``start_s + k*step`` for ``k = 1..n_points``, keyed by time."""
        step = self.step_seconds
        samples: dict[int, float] = {}
        labels_seen: list[dict[str, str]] = []
        done = 0
        while done < n_points:
            chunk = min(self.max_points_per_query, n_points - done)
            first_eval = start_s + (done + 1) * step
            last_eval = start_s + (done + chunk) * step
            data = self._query_range(model_id, query, first_eval, last_eval)
            for series in data:
                metric = series.get("metric") or {}
                if metric not in labels_seen:
                    labels_seen.append(metric)
                if len(labels_seen) > 1:
                    shown = ", ".join(_format_labels(m) for m in labels_seen[:3])
                    raise PrometheusQueryError(
                        f"query for model {model_id!r} returned more than one series ({shown}); "
                        f"the expression must give one number per step: wrap it in sum(...), "
                        f"e.g. sum({query}). Query: {query}",
                        model_id=model_id,
                        query=query,
                        error_type="multiple_series",
                    )
                for point in series.get("values") or []:
                    t, value = self._parse_point(model_id, query, point)
                    if (t - start_s) % step or not first_eval <= t <= last_eval:
                        raise PrometheusQueryError(
                            f"query for model {model_id!r} returned a sample at {_iso(t)}, "
                            f"not an evaluation time of the range. Query: {query}",
                            model_id=model_id,
                            query=query,
                            error_type="bad_response",
                        )
                    samples[int(t)] = value
            done += chunk
        return samples

    def _parse_point(self, model_id: str, query: str, point: Any) -> tuple[int, float]:
        try:
            t_raw, v_raw = point
            t = float(t_raw)
            value = float(v_raw)
        except (TypeError, ValueError) as exc:
            raise PrometheusQueryError(
                f"query for model {model_id!r} returned an unreadable sample {point!r}. Query: {query}",
                model_id=model_id,
                query=query,
                error_type="bad_response",
            ) from exc
        if t != int(t):
            raise PrometheusQueryError(
                f"query for model {model_id!r} returned a sample at {t!r}, not an evaluation time "
                f"of the range. Query: {query}",
                model_id=model_id,
                query=query,
                error_type="bad_response",
            )
        if abs(value) > _MAX_EXACT and not math.isinf(value):
            raise PrometheusQueryError(
                f"query for model {model_id!r} returned {v_raw} at {_iso(int(t))}, too large to be a "
                f"count. Query: {query}",
                model_id=model_id,
                query=query,
                error_type="too_large",
            )
        if math.isnan(value) or math.isinf(value):
            kind = "NaN" if math.isnan(value) else "infinite"
            raise PrometheusQueryError(
                f"query for model {model_id!r} returned a {kind} value ({v_raw}) at {_iso(int(t))} "
                f"(the step starting {_iso(int(t) - self.step_seconds)}); a count must be a finite "
                f"number. Query: {query}",
                model_id=model_id,
                query=query,
                error_type="nan" if kind == "NaN" else "infinite",
            )
        return int(t), value

    def _query_range(self, model_id: str, query: str, first_eval: int, last_eval: int) -> list[dict]:
        url = f"{self.base_url}/api/v1/query_range"
        params = {"query": query, "start": str(first_eval), "end": str(last_eval), "step": f"{self.step_seconds}s"}
        try:
            response = self._client.get(url, params=params, timeout=self.timeout_s)
        except httpx.TimeoutException as exc:
            raise PrometheusUnavailable(
                f"Prometheus at {self.base_url} did not answer within {self.timeout_s:g} s "
                f"(model {model_id!r}): {exc!r}"
            ) from exc
        except httpx.TransportError as exc:
            raise PrometheusUnavailable(f"cannot reach Prometheus at {self.base_url} (model {model_id!r}): {exc!r}") from exc

        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("status") == "error":
            error_type = str(body.get("errorType", ""))
            error = str(body.get("error", ""))
            # bad_data (parse errors, too many points) and execution (many-to-many
            # matching, too many samples) concern this query only; timeout,
            # canceled, unavailable and internal errors are the server's.
            if error_type in ("bad_data", "execution"):
                raise PrometheusQueryError(
                    f"Prometheus rejected the query for model {model_id!r} ({error_type}): {error}. "
                    f"Query: {query}",
                    model_id=model_id,
                    query=query,
                    error_type=error_type,
                )
            raise PrometheusUnavailable(
                f"Prometheus at {self.base_url} failed the query for model {model_id!r} "
                f"(HTTP {response.status_code}, {error_type or 'error'}): {error}"
            )
        if response.is_error:
            raise PrometheusUnavailable(
                f"Prometheus at {self.base_url} answered HTTP {response.status_code} "
                f"for model {model_id!r}: {response.text[:200]!r}"
            )
        if not isinstance(body, dict) or body.get("status") != "success":
            raise PrometheusUnavailable(
                f"{url} did not answer with Prometheus API JSON (HTTP {response.status_code}): "
                f"{response.text[:200]!r}"
            )
        data = body.get("data") or {}
        if data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
            raise PrometheusQueryError(
                f"query for model {model_id!r} gave a {data.get('resultType')!r} result, expected a "
                f"matrix. Query: {query}",
                model_id=model_id,
                query=query,
                error_type="bad_response",
            )
        return data["result"]


def _iso(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def _format_labels(metric: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{escape_promql_string(str(v))}"' for k, v in sorted(metric.items())) + "}"
