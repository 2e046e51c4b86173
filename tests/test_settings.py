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


# --- DATABASE_URL: never the password, one clear line when it does not parse ---------------------------------------


@pytest.mark.parametrize("url", [
    "postgresql+asyncpg://pw:S3cretPassw0rd@127.0.0.1:55432/pwdb",  # a driver other than psycopg
    "mysql://pw:S3cretPassw0rd@127.0.0.1:3306/x",
    "postgresql://pw:S3cretPassw0rd@db:notaport/pwdb",
])
def test_a_bad_database_url_is_shown_without_its_password(monkeypatch, url):
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert "S3cretPassw0rd" not in message
    assert "DATABASE_URL='" in message and ":***@" in message


@pytest.mark.parametrize("password", ["p@ss:w/rd%#?x", "p@ss", "pw:with:colons@and@ats"])
def test_a_password_with_raw_special_characters_is_one_clear_error_naming_database_url(monkeypatch, password):
    """An unencoded '@' or ':' in the password split the URL wrongly: SQLAlchemy read the rest as host and port
    ("invalid literal for int()" with a traceback when the engine was made) or connected to a wrong host."""
    monkeypatch.setenv("DATABASE_URL", f"postgresql://pw:{password}@127.0.0.1:55432/pwdb")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith("invalid settings: DATABASE_URL='postgresql://pw:***@127.0.0.1:55432/pwdb': ")
    assert "percent-encode" in message and "%40" in message
    assert password not in message
    assert "\n" not in message


def test_a_percent_encoded_password_is_accepted(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://pw:p%40ss%3Aw%2Frd%25%23%3Fx@127.0.0.1:55432/pwdb")
    settings = load_settings()
    from sqlalchemy.engine import make_url

    assert make_url(settings.database_url).password == "p@ss:w/rd%#?x"
    assert "p%40ss" not in repr(settings)  # the settings' repr leaves the URL out


def test_settings_errors_raised_directly_hide_the_url(monkeypatch):
    """Settings() itself (the API's worker processes) raises pydantic's error, whose text showed the input."""
    from pydantic import ValidationError

    from forecaster.settings import Settings

    with pytest.raises(ValidationError) as info:
        Settings(database_url="mysql://pw:S3cretPassw0rd@db/x")
    assert "S3cretPassw0rd" not in str(info.value)


@pytest.mark.parametrize("url, shown", [
    ("postgresql+psycopg://u:secret@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
    ("postgresql://u:p@ss:w/rd%#?x@h:5432/db", "postgresql://u:***@h:5432/db"),
    ("postgresql://u@h/db?password=secret&sslmode=require", "postgresql://u@h/db?password=***&sslmode=require"),
    ("postgresql+psycopg://postgres@/postgres?host=/tmp/s", "postgresql+psycopg://postgres@/postgres?host=/tmp/s"),
    ("postgresql://u:@h/db", "postgresql://u:@h/db"),
    ("not a url password=secret", "not a url password=***"),
])
def test_mask_url(url, shown):
    from forecaster.settings import mask_url

    assert mask_url(url) == shown


# --- cross-field errors and secret settings: never the secrets in the message ---------------------------------------


def test_a_cross_field_error_shows_its_message_and_no_secret(monkeypatch):
    """A model_validator's error has no location: its 'input' is the whole settings dict, which was printed as
    PREWARM_SETTINGS={...} with the database password, the agent token and the S3 secret key in clear."""
    monkeypatch.setenv("DATABASE_URL", "postgresql://prewarm:Db-Passw0rd-XYZ@db.internal:5432/prewarm")
    monkeypatch.setenv("PREWARM_AGENT_TOKEN", "agent-token-SECRET-123")
    monkeypatch.setenv("PREWARM_AGENT_S3_SECRET_ACCESS_KEY", "s3-SECRET-KEY-456")
    monkeypatch.setenv("PREWARM_PLANS_RETENTION_DAYS", "1")
    with pytest.raises(SettingsError) as info:
        load_settings()
    message = str(info.value)
    for secret in ("Db-Passw0rd-XYZ", "agent-token-SECRET-123", "s3-SECRET-KEY-456"):
        assert secret not in message
    assert "PREWARM_SETTINGS=" not in message and "{" not in message
    assert "PREWARM_PLANS_RETENTION_DAYS=1 would delete" in message


def test_a_bad_value_of_a_secret_setting_is_not_shown(monkeypatch):
    with pytest.raises(SettingsError) as info:
        load_settings(agent_token=["tok-SECRET-789"], agent_s3_secret_access_key=["s3-SECRET-KEY-456"])
    message = str(info.value)
    assert "tok-SECRET-789" not in message and "s3-SECRET-KEY-456" not in message
    assert "PREWARM_AGENT_TOKEN='***'" in message and "PREWARM_AGENT_S3_SECRET_ACCESS_KEY='***'" in message


# --- floats: finite, and bounded where the database or datetime arithmetic has a limit ------------------------------


def _numeric_fields():
    """(name, field, types) of every Settings field whose value may be an int or a float (bool is not)."""
    import types
    import typing

    from forecaster.settings import Settings

    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
            else (annotation,)
        numeric = {t for t in members if t in (int, float)}
        if numeric:
            yield name, field, numeric


@pytest.mark.parametrize("name", [name for name, _, types in _numeric_fields() if float in types])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_no_float_setting_takes_inf_or_nan(monkeypatch, name, value):
    """PREWARM_MAX_FUTURE_SKEW_S=inf and PREWARM_PUSH_LOCK_TIMEOUT_S=inf were accepted and made every push a 500."""
    env_name = f"PREWARM_{name.upper()}"
    monkeypatch.setenv(env_name, value)
    with pytest.raises(SettingsError, match=f"{env_name}='{value}': Input should be a finite number"):
        load_settings()


def test_push_lock_timeout_fits_postgresqls_lock_timeout(monkeypatch):
    """10,000,000 s was accepted, then every push was a 422 'value out of the database's range' blaming the client:
    lock_timeout is set in ms and takes at most 2,147,483,647."""
    monkeypatch.setenv("PREWARM_PUSH_LOCK_TIMEOUT_S", "10000000")
    with pytest.raises(SettingsError, match="PREWARM_PUSH_LOCK_TIMEOUT_S='10000000': Input should be less than or "
                                            "equal to 2147483"):
        load_settings()
    from forecaster.settings import MAX_PUSH_LOCK_TIMEOUT_S

    assert round(MAX_PUSH_LOCK_TIMEOUT_S * 1000) <= 2_147_483_647  # forecaster.store.db sets it in ms
    monkeypatch.setenv("PREWARM_PUSH_LOCK_TIMEOUT_S", str(MAX_PUSH_LOCK_TIMEOUT_S))
    assert load_settings().push_lock_timeout_s == MAX_PUSH_LOCK_TIMEOUT_S


def test_future_skew_is_bounded(monkeypatch):
    monkeypatch.setenv("PREWARM_MAX_FUTURE_SKEW_S", "1e12")
    with pytest.raises(SettingsError, match="PREWARM_MAX_FUTURE_SKEW_S='1e12': Input should be less than or equal"):
        load_settings()


# --- every number has an upper bound -------------------------------------------------------------------------------

#: Numeric settings with no ``le``/``lt`` in their Field, and why that is safe.
UNBOUNDED_ALLOWED = {
    "api_workers": "int | 'auto': its before-validator (_workers) refuses anything but 1-64 or 'auto'",
}


def test_every_numeric_setting_has_an_upper_bound():
    """Some 37 int and float settings had none: 1,000,000 retention days or a lag of 1e11 s loaded fine and then
    failed their jobs every slot (OverflowError). A new numeric setting needs a bound or a reason here."""
    import annotated_types

    unbounded = [name for name, field, _ in _numeric_fields()
                 if not any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in field.metadata)
                 and name not in UNBOUNDED_ALLOWED]
    assert unbounded == []


def test_every_upper_bound_keeps_time_arithmetic_finite():
    """The largest value of each time setting still works as a timedelta either side of now (datetime's range)."""
    from datetime import datetime, timedelta, timezone

    import annotated_types

    now = datetime.now(timezone.utc)
    unit = {"_days": "days", "_min": "minutes", "_minutes": "minutes", "_h": "hours", "_s": "seconds"}
    for name, field, _ in _numeric_fields():
        bound = next((m.le if isinstance(m, annotated_types.Le) else m.lt for m in field.metadata
                      if isinstance(m, (annotated_types.Le, annotated_types.Lt))), None)
        suffix = next((s for s in unit if name.endswith(s)), None)
        if bound is None or suffix is None:
            continue
        span = timedelta(**{unit[suffix]: bound})
        assert now - span < now + span, name


@pytest.mark.parametrize(("env", "value"), [
    ("PREWARM_FORECAST_RETENTION_DAYS", "1000000"),
    ("PREWARM_INVOCATIONS_RETENTION_DAYS", "1000000"),
    ("PREWARM_ERROR_ROLLUP_RETENTION_DAYS", "1000000"),
    ("PREWARM_PROMETHEUS_LAG_S", "100000000000"),
])
def test_sizes_that_overflowed_their_jobs_are_refused_at_load(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError, match=f"{env}='{value}': Input should be less than or equal to"):
        load_settings()


def test_a_hundred_years_of_retention_is_accepted(monkeypatch):
    for name in ("INVOCATIONS_MINUTE_DAYS", "INVOCATIONS_5MIN_DAYS", "INVOCATIONS_RETENTION_DAYS",
                 "FORECAST_RETENTION_DAYS", "ERROR_ROLLUP_RETENTION_DAYS"):
        monkeypatch.setenv(f"PREWARM_{name}", "36500")
    assert load_settings().invocations_retention_days == 36_500


# --- an empty PREWARM_DATABASE_URL is as if unset ------------------------------------------------------------------


@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_prewarm_database_url_does_not_hide_database_url(monkeypatch, empty):
    """The alias choice took the first name present: PREWARM_DATABASE_URL='' won, '' became None, and an embedded
    database was opened (development) or DATABASE_URL said missing (production) while it was set."""
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p@db:5432/prewarm")
    monkeypatch.setenv("PREWARM_DATABASE_URL", empty)
    assert load_settings().database_url == "postgresql+psycopg://u:p@db:5432/prewarm"
    monkeypatch.setenv("PREWARM_ENVIRONMENT", "production")
    assert load_settings().database_url == "postgresql+psycopg://u:p@db:5432/prewarm"


def test_an_empty_database_url_in_the_environment_does_not_hide_the_settings_files(monkeypatch, tmp_path):
    env_file = tmp_path / "prewarm.env"
    env_file.write_text("DATABASE_URL=postgresql://u:p@db:5432/prewarm\n")
    monkeypatch.setenv("PREWARM_SETTINGS_FILE", str(env_file))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("PREWARM_DATABASE_URL", "")
    assert load_settings().database_url == "postgresql+psycopg://u:p@db:5432/prewarm"


def test_prewarm_database_url_still_comes_first(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p@db:5432/other")
    monkeypatch.setenv("PREWARM_DATABASE_URL", "postgresql://u:p@db:5432/prewarm")
    assert load_settings().database_url == "postgresql+psycopg://u:p@db:5432/prewarm"


# --- listen addresses are never empty -------------------------------------------------------------------------------


@pytest.mark.parametrize("env", ["PREWARM_API_HOST", "PREWARM_AGENT_HOST"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_listen_host_is_refused_naming_the_setting(monkeypatch, env, value):
    """PREWARM_API_HOST='' was accepted and `prewarm serve` listened on every interface."""
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError, match=f"{env}='{value}': .*it is empty"):
        load_settings()


def test_a_listen_host_is_stripped(monkeypatch):
    monkeypatch.setenv("PREWARM_API_HOST", " 0.0.0.0 ")
    assert load_settings().api_host == "0.0.0.0"


# --- misspelt PREWARM_* names are warned about, with the nearest setting --------------------------------------------


def test_a_misspelt_setting_is_warned_about_with_the_nearest_name(monkeypatch, tmp_path, caplog):
    """PREWARM_ACTUATOR_KILLSWITCH=true was ignored without a word: the kill switch stayed off."""
    env_file = tmp_path / "prewarm.env"
    env_file.write_text("PREWARM_PLANNER_GPU_BUGET=4\n")
    monkeypatch.setenv("PREWARM_SETTINGS_FILE", str(env_file))
    monkeypatch.setenv("PREWARM_ACTUATOR_KILLSWITCH", "true")
    monkeypatch.setenv("PREWARM_TEST_ADMIN_URL", "postgresql://x@y/z")  # the project's own, not a setting: no word
    with caplog.at_level("WARNING", logger="forecaster.settings"):
        settings = load_settings()
    assert settings.actuator_kill_switch is False  # warned, not refused
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "PREWARM_ACTUATOR_KILLSWITCH (in the environment) is not a setting and is ignored; did you mean "
        "PREWARM_ACTUATOR_KILL_SWITCH?",
        f"PREWARM_PLANNER_GPU_BUGET (in the settings file {env_file}) is not a setting and is ignored; did you "
        "mean PREWARM_PLANNER_GPU_BUDGET?",
    ]


def test_known_names_are_not_warned_about(monkeypatch, caplog):
    monkeypatch.setenv("PREWARM_ACTUATOR_KILL_SWITCH", "true")
    monkeypatch.setenv("prewarm_api_port", "8081")  # names are not case-sensitive
    monkeypatch.setenv("DATABASE_URL", "postgresql://u@db/prewarm")
    monkeypatch.setenv("PREWARM_DATABASE_URL", "postgresql://u@db/prewarm")
    with caplog.at_level("WARNING", logger="forecaster.settings"):
        assert load_settings().api_port == 8081
    assert [r for r in caplog.records if r.levelname == "WARNING"] == []
