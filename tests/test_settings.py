"""Settings: environment with the PREWARM_ prefix, DATABASE_URL, a settings file, errors that name the value."""

from __future__ import annotations

import pytest

from forecaster.settings import SettingsError, load_settings


def test_database_url_is_normalised_to_psycopg(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p@db:5432/prewarm")
    assert load_settings().database_url == "postgresql+psycopg://u:p@db:5432/prewarm"


def test_unset_database_url_means_embedded_under_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("PREWARM_DATABASE_URL", raising=False)
    monkeypatch.setenv("PREWARM_DATA_DIR", str(tmp_path))
    settings = load_settings()
    assert settings.database_url is None
    assert settings.embedded_pgdata == tmp_path / "postgres"


def test_errors_name_variable_and_value(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "mysql://root@db/x")
    monkeypatch.setenv("PREWARM_MAX_FUTURE_SKEW_S", "-5")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert "DATABASE_URL='mysql://root@db/x'" in message
    assert "PREWARM_MAX_FUTURE_SKEW_S='-5'" in message


def test_settings_file_and_missing_file(monkeypatch, tmp_path):
    env_file = tmp_path / "prewarm.env"
    env_file.write_text("PREWARM_PARTITION_DAYS_AHEAD=3\nPREWARM_AUTO_REGISTER_MODELS=true\n")
    monkeypatch.setenv("PREWARM_SETTINGS_FILE", str(env_file))
    settings = load_settings()
    assert settings.partition_days_ahead == 3 and settings.auto_register_models is True
    monkeypatch.setenv("PREWARM_SETTINGS_FILE", str(tmp_path / "nope.env"))
    with pytest.raises(SettingsError, match="nope.env"):
        load_settings()


def test_production_refuses_the_embedded_database(monkeypatch):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("PREWARM_ENVIRONMENT", "production")
    with pytest.raises(SettingsError, match="requires DATABASE_URL"):
        load_settings()


def test_prometheus_template_must_name_the_model(monkeypatch):
    monkeypatch.setenv("PREWARM_PROMETHEUS_QUERY_TEMPLATE", "sum(rate(x[1m]))")
    with pytest.raises(SettingsError, match="PREWARM_PROMETHEUS_QUERY_TEMPLATE"):
        load_settings()


@pytest.mark.parametrize(("value", "problem"), [
    ("max_over_time(x[1m:10s])", "placeholder"),
    ('max_over_time(x{model_name="{model_id}"}[1m:10s])', "literal braces"),  # braces not doubled
])
def test_prometheus_burst_template_must_name_the_model_and_format(monkeypatch, value, problem):
    monkeypatch.setenv("PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE", value)
    with pytest.raises(SettingsError, match=f"PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE(.|\n)*{problem}"):
        load_settings()


def test_prometheus_burst_template_is_optional(monkeypatch):
    monkeypatch.setenv("PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE", " ")
    assert load_settings().prometheus_burst_query_template is None
    monkeypatch.setenv("PREWARM_PROMETHEUS_BURST_QUERY_TEMPLATE",
                       'max_over_time(sum(increase(c{{model_name="{model_id}"}}[10s]))[1m:10s])')
    assert load_settings().prometheus_burst_query_template.startswith("max_over_time")


def test_forecast_weighting_is_one_of_the_ensembles_rules(monkeypatch):
    monkeypatch.setenv("PREWARM_FORECAST_WEIGHTING", "best")
    assert load_settings().forecast_weighting == "best"
    monkeypatch.setenv("PREWARM_FORECAST_WEIGHTING", "stacking")
    with pytest.raises(SettingsError, match="PREWARM_FORECAST_WEIGHTING(.|\n)*stacking"):
        load_settings()


def test_forecast_members_are_known_families_in_the_ensembles_order(monkeypatch):
    assert load_settings().forecast_members == "lightgbm,xgboost,random_forest,arima,lstm"
    monkeypatch.setenv("PREWARM_FORECAST_MEMBERS", " lstm, lightgbm ")
    assert load_settings().forecast_members == "lightgbm,lstm"


@pytest.mark.parametrize(("value", "problem"), [
    ("lightgbm,prophet", r"unknown member families \['prophet'\]"),
    ("arima,arima", "named twice"),
    (" , ", "at least one member family"),
])
def test_forecast_members_refuse_what_the_ensemble_cannot_build(monkeypatch, value, problem):
    monkeypatch.setenv("PREWARM_FORECAST_MEMBERS", value)
    with pytest.raises(SettingsError, match=f"PREWARM_FORECAST_MEMBERS(.|\n)*{problem}"):
        load_settings()
