"""A small global LSTM (torch) across all series: the last ``lookback`` steps in, ``horizon`` steps out.

Each training sample is one (series, origin) window. The window is divided by
its own recent level (mean of the window, floored at a tenth of the series'
fit-window mean, which is itself the per-series scale), fed as ``log1p``
together with a known/unknown flag and the minute of hour (sine, cosine) of
every step; the series' ``log1p`` fit mean, the log of the window level and,
per season (15, 30, 60 minutes) and output horizon, the latest same-phase value
are appended to the last hidden state. The head outputs all horizons at once
(direct multi-output, like the tree members' direct strategy) as ``log1p`` of
the level-relative count, trained on absolute error: the median commutes with
the monotone ``log1p``, so ``expm1`` of the output estimates the median count,
while the log keeps the rare huge relative counts of quiet series from
swamping the loss (on the raw relative scale the loss did not decrease).

Runs on CUDA when available (``device=None``), else on CPU. Training runs a fixed number of epochs of a fixed
number of windows, so its cost does not grow with the fleet and its result does not depend on the machine's load;
a wall-time cap (:data:`MAX_FIT_SECONDS`) far above a normal fit is only a safety net.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from forecaster.forecast.members import Member, default_seasons
from forecaster.forecast.panel import Panel
from forecaster.forecast.trees import _mean_or_zero, series_scale

log = logging.getLogger(__name__)

LEVEL_FLOOR = 0.1
#: wall seconds after which training stops (checked per batch): a safety net for a pathological machine. The 8 epochs
#: of 20,000 windows take tens of seconds on 2 shared cores; a 60 s cap used to cut them on a loaded machine, so two
#: fits of the same data differed with the load (the report's figures moved between runs)
MAX_FIT_SECONDS = 600.0


def pick_device(device: str | None = None) -> str:
    """``device`` if given, else ``"cuda"`` when torch sees a GPU, else ``"cpu"``."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _network(hidden: int, horizon: int, n_static: int):
    import torch
    from torch import nn

    class SequenceForecaster(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(input_size=4, hidden_size=hidden, batch_first=True)
            self.head = nn.Sequential(nn.Linear(hidden + n_static, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, horizon))

        def forward(self, sequence: torch.Tensor, static: torch.Tensor) -> torch.Tensor:
            _, (state, _) = self.lstm(sequence)
            return self.head(torch.cat([state[-1], static], dim=1))

    return SequenceForecaster()


class LSTMMember(Member):
    """Global LSTM member.

    Args:
        horizon: steps the head outputs; a longer request repeats the last one.
        lookback: steps of history per window (60 = one hour per minute).
        hidden: LSTM width.
        samples: training windows drawn per epoch (uniform over series and origins).
        epochs: at most this many passes.
        max_seconds: stop training after this many wall seconds (checked per batch; logged when it
            triggers): a safety net, see :data:`MAX_FIT_SECONDS`.
        batch_size: windows per step.
        learning_rate: Adam step size.
        device: ``"cuda"``, ``"cpu"`` or ``None`` (automatic).
        n_jobs: CPU threads for torch while fitting and forecasting.
        random_state: seed for sampling and initialisation.
    """

    name = "lstm"

    def __init__(
        self,
        horizon: int = 60,
        lookback: int = 60,
        hidden: int = 32,
        samples: int = 20_000,
        epochs: int = 8,
        max_seconds: float = MAX_FIT_SECONDS,
        batch_size: int = 512,
        learning_rate: float = 5e-3,
        device: str | None = None,
        n_jobs: int = 1,
        random_state: int = 0,
    ):
        self.horizon = horizon
        self.lookback = lookback
        self.hidden = hidden
        self.samples = samples
        self.epochs = epochs
        self.max_seconds = max_seconds
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.device = device
        self.n_jobs = n_jobs
        self.random_state = random_state

    # ------------------------------------------------------------------ windows
    def _windows(
        self, scaled: np.ndarray, rows: np.ndarray, origins: np.ndarray, log_mean: np.ndarray, first_step: int,
        minutes_per_step: float,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Inputs ``(R, lookback, 4)``, static ``(R, 2)`` and the level ``(R,)`` for windows ending before ``origins``."""
        lb = self.lookback
        columns = origins[:, None] - lb + np.arange(lb)[None, :]
        values = scaled[rows[:, None], np.clip(columns, 0, None)]
        values[columns < 0] = np.nan
        known = ~np.isnan(values)
        with np.errstate(invalid="ignore"):
            level = np.where(known.any(axis=1), np.nansum(values, axis=1) / np.maximum(known.sum(axis=1), 1), 0.0)
        level = np.maximum(level, LEVEL_FLOOR)
        x = np.log1p(np.where(known, values, 0.0) / level[:, None])
        angle = 2 * np.pi * (((first_step + columns) * minutes_per_step) % 60) / 60
        sequence = np.stack([x, known.astype(np.float64), np.sin(angle), np.cos(angle)], axis=2)
        static = [log_mean[rows], np.log(level)]
        # the latest same-phase value for every output horizon and season: the head can
        # copy a timer's pattern instead of having to count steps through the LSTM
        steps = np.arange(1, self.horizon + 1)[None, :]
        for p in self.seasons_:
            source = origins[:, None] + steps - 1 - p * np.ceil(steps / p).astype(np.int64)
            seasonal = scaled[rows[:, None], np.clip(source, 0, None)]
            seasonal = np.where((source < 0) | np.isnan(seasonal), 0.0, seasonal)
            static.extend(np.log1p(seasonal / level[:, None]).T)
        return sequence.astype(np.float32), np.stack(static, axis=1).astype(np.float32), level

    # ------------------------------------------------------------------ fit
    def _fit(self, panel: Panel) -> None:
        import torch

        self.device_ = pick_device(self.device)
        threads = torch.get_num_threads()
        torch.set_num_threads(self.n_jobs)
        try:
            self._train(panel, torch)
        finally:
            torch.set_num_threads(threads)

    def _train(self, panel: Panel, torch) -> None:
        started = time.perf_counter()
        rng = np.random.default_rng(self.random_state)
        torch.manual_seed(self.random_state)
        self.scale_ = series_scale(panel.values)
        self.log_mean_ = np.log1p(_mean_or_zero(panel.values))
        scaled = panel.values / self.scale_[:, None]
        horizon = self.horizon
        first = min(self.lookback, max(1, panel.n_steps // 4))
        last = panel.n_steps - horizon
        if last < first:
            raise ValueError(f"fit window too short for lstm: {panel.n_steps} steps, horizon {horizon}")
        self.seasons_ = list(default_seasons(panel.step, panel.n_steps))
        network = _network(self.hidden, horizon, 2 + horizon * len(self.seasons_)).to(self.device_)
        optimiser = torch.optim.Adam(network.parameters(), lr=self.learning_rate)
        first_step = int(panel.step_index(0, 1)[0])
        self.losses_: list[float] = []
        self.epochs_run_ = 0
        stop = False
        for _ in range(self.epochs):
            rows = rng.integers(0, panel.n_series, self.samples)
            origins = rng.integers(first, last + 1, self.samples)
            sequence, static, level = self._windows(
                scaled, rows, origins, self.log_mean_, first_step, panel.step_minutes
            )
            target_columns = origins[:, None] + np.arange(horizon)[None, :]
            target = np.log1p(scaled[rows[:, None], target_columns] / level[:, None])
            known = ~np.isnan(target)
            target = np.where(known, target, 0.0).astype(np.float32)
            epoch_loss, batches = 0.0, 0
            for start in range(0, self.samples, self.batch_size):
                part = slice(start, start + self.batch_size)
                seq = torch.from_numpy(sequence[part]).to(self.device_)
                stat = torch.from_numpy(static[part]).to(self.device_)
                tgt = torch.from_numpy(target[part]).to(self.device_)
                mask = torch.from_numpy(known[part].astype(np.float32)).to(self.device_)
                loss = ((network(seq, stat) - tgt).abs() * mask).sum() / mask.sum().clamp(min=1.0)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                epoch_loss += float(loss.detach())
                batches += 1
                if time.perf_counter() - started > self.max_seconds:
                    stop = True
                    break
            self.losses_.append(epoch_loss / max(batches, 1))
            self.epochs_run_ += 1
            if stop:
                log.warning("lstm: training stopped after %.0f s (max_seconds %.0f), %d of %d epochs",
                            time.perf_counter() - started, self.max_seconds, self.epochs_run_, self.epochs)
                break
        self.network_ = network.eval()
        self.fit_seconds_ = time.perf_counter() - started

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        """The network's class is built inside :func:`_network` (torch is imported lazily), so plain pickle
        cannot name it: keep its weights and shape instead and rebuild it on load."""
        state = dict(self.__dict__)
        network = state.pop("network_", None)
        if network is not None:
            state["network_weights_"] = {k: v.detach().cpu() for k, v in network.state_dict().items()}
            state["network_shape_"] = (self.hidden, self.horizon, 2 + self.horizon * len(self.seasons_))
        return state

    def __setstate__(self, state: dict) -> None:
        weights = state.pop("network_weights_", None)
        shape = state.pop("network_shape_", None)
        self.__dict__.update(state)
        if weights is not None:
            self.device_ = pick_device(self.device)  # saved on a GPU machine, loaded where there may be none
            network = _network(*shape)
            network.load_state_dict(weights)
            self.network_ = network.to(self.device_).eval()

    # ------------------------------------------------------------------ forecast
    def _forecast(self, panel: Panel, origins: list[int], h: int) -> np.ndarray:
        import torch

        before = panel.values[:, : min(origins)]
        scale = self._per_series(panel, self.scale_, series_scale(before))
        log_mean = self._per_series(panel, self.log_mean_, np.log1p(_mean_or_zero(before)))
        scaled = panel.values / scale[:, None]
        n = panel.n_series
        rows = np.repeat(np.arange(n), len(origins))
        origin = np.tile(np.asarray(origins), n)
        out = np.empty((len(rows), self.horizon))
        threads = torch.get_num_threads()
        torch.set_num_threads(self.n_jobs)
        try:
            with torch.no_grad():
                chunk = 8192
                for start in range(0, len(rows), chunk):
                    part = slice(start, start + chunk)
                    sequence, static, level = self._windows(
                        scaled, rows[part], origin[part], log_mean, int(panel.step_index(0, 1)[0]), panel.step_minutes
                    )
                    prediction = self.network_(
                        torch.from_numpy(sequence).to(self.device_), torch.from_numpy(static).to(self.device_)
                    )
                    out[part] = np.expm1(prediction.cpu().numpy().astype(np.float64)) * level[:, None]
        finally:
            torch.set_num_threads(threads)
        out = out * scale[rows, None]
        if h > self.horizon:
            out = np.concatenate([out, np.repeat(out[:, -1:], h - self.horizon, axis=1)], axis=1)
        return out[:, :h].reshape(n, len(origins), h)
