"""One validated settings object for the whole service.

Values come from environment variables with the ``PREWARM_`` prefix (the
database also from the conventional ``DATABASE_URL``), optionally from a
dotenv-style file named by ``PREWARM_SETTINGS_FILE``. Settings are loaded once
at the edge (CLI, service start-up) and passed inward; domain code never reads
the environment itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class SettingsError(ValueError):
    """Settings could not be loaded; the message names each bad variable and value."""


def _default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("prewarm", appauthor=False))


def _default_traces_dir() -> Path:
    return REPO_ROOT.parent / "shared" / "traces"


class Settings(BaseSettings):
    """Service settings; see README for the full list with defaults."""

    model_config = SettingsConfigDict(env_prefix="PREWARM_", extra="ignore", validate_default=True)

    environment: Literal["development", "production"] = "development"

    # --- database -------------------------------------------------------
    database_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("PREWARM_DATABASE_URL", "DATABASE_URL"),
        description="SQLAlchemy URL of PostgreSQL; unset starts an embedded server under data_dir.",
    )
    data_dir: Path = Field(default_factory=_default_data_dir)
    db_wait_timeout_s: float = Field(default=60.0, gt=0)
    db_retry_attempts: int = Field(default=5, ge=1, le=50)
    db_retry_base_delay_s: float = Field(default=0.5, ge=0)

    # --- files ----------------------------------------------------------
    models_dir: Path = Field(default=REPO_ROOT / "models")
    traces_dir: Path = Field(default_factory=_default_traces_dir)

    # --- ingest ---------------------------------------------------------
    auto_register_models: bool = False
    max_future_skew_s: float = Field(default=300.0, ge=0)
    partition_days_ahead: int = Field(default=7, ge=1, le=366)

    # --- Prometheus -----------------------------------------------------
    prometheus_url: str | None = None
    prometheus_query_template: str = (
        'sum(increase(vllm:request_success_total{{model_name="{model_id}"}}[1m]))'
    )
    prometheus_lag_s: int = Field(default=120, ge=0, description="Wait this long before a minute is final.")
    prometheus_backfill_minutes: int = Field(default=60, ge=1, le=10_080)
    prometheus_timeout_s: float = Field(default=10.0, gt=0)

    # --- scheduler ------------------------------------------------------
    ingest_interval_s: int = Field(default=60, ge=1)
    partition_maintenance_interval_s: int = Field(default=3600, ge=60)
    forecast_interval_s: int = Field(default=60, ge=1)
    retrain_hour_utc: int = Field(default=3, ge=0, le=23)

    @field_validator("database_url")
    @classmethod
    def _normalise_database_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        for prefix in ("postgres://", "postgresql://"):
            if value.startswith(prefix):
                return "postgresql+psycopg://" + value[len(prefix):]
        if not value.startswith("postgresql+psycopg://"):
            raise ValueError(
                f"must be a PostgreSQL URL (postgresql://user@host:port/db), got {value!r}"
            )
        return value

    @field_validator("prometheus_query_template")
    @classmethod
    def _template_names_model(cls, value: str) -> str:
        if "{model_id}" not in value:
            raise ValueError(f"must contain the placeholder {{model_id}}, got {value!r}")
        return value

    @model_validator(mode="after")
    def _production_needs_database(self) -> "Settings":
        if self.environment == "production" and self.database_url is None:
            raise ValueError("environment=production requires DATABASE_URL; the embedded database is for development")
        return self

    @property
    def embedded_pgdata(self) -> Path:
        """Where the embedded PostgreSQL keeps its data between runs."""
        return self.data_dir / "postgres"


def load_settings(**overrides: object) -> Settings:
    """Load settings from the environment (and ``PREWARM_SETTINGS_FILE``).

    Raises:
        SettingsError: naming each invalid variable, its value and the reason.
    """
    env_file = os.environ.get("PREWARM_SETTINGS_FILE")
    if env_file and not Path(env_file).is_file():
        raise SettingsError(f"PREWARM_SETTINGS_FILE={env_file!r}: no such file")
    try:
        return Settings(_env_file=env_file, **overrides)  # type: ignore[call-arg]
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else "settings"
            if name.lower() in ("database_url", "prewarm_database_url"):
                env_name = "PREWARM_DATABASE_URL" if os.environ.get("PREWARM_DATABASE_URL") else "DATABASE_URL"
            elif name.upper().startswith("PREWARM_"):
                env_name = name.upper()
            else:
                env_name = f"PREWARM_{name.upper()}"
            shown = err.get("input")
            problems.append(f"{env_name}={shown!r}: {err['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None
