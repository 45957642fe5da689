"""`Settings.load`: flag > `E31_*` environment > config file > default, and errors naming the
variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from e31.core.errors import ConfigError
from e31.core.sizeclasses import DEFAULT_SIZE_CLASSES
from e31.edge.settings import Settings

REPO_CONFIG = Path(__file__).parents[2] / "config" / "e31.toml"


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty E31_HOME, so no user's ~/.e31/e31.toml leaks into a test."""
    path = tmp_path / "home"
    path.mkdir()
    return path


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "custom.toml"
    path.write_text(text)
    return path


def test_without_file_env_or_flags_every_setting_is_its_default(home: Path) -> None:
    # Given nothing but an empty home
    # When settings are loaded
    s = Settings.load(environ={"E31_HOME": str(home)})

    # Then every value is the built-in default, and home is the one given
    assert s.model_dump(exclude={"home"}) == Settings().model_dump(exclude={"home"})
    assert s.home == home
    assert s.api_port == 8031
    assert s.size_classes == DEFAULT_SIZE_CLASSES


def test_the_config_file_overrides_defaults(tmp_path: Path, home: Path) -> None:
    # Given a config file that changes the API port and the retry default
    config = write_config(tmp_path, "[api]\napi_port = 9000\n[retries]\nmax = 2\n")

    # When settings are loaded with E31_CONFIG pointing at it
    s = Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(config)})

    # Then the file's values win over the defaults, and the rest stay default
    assert s.api_port == 9000
    assert s.retries.max == 2
    assert s.flower_port == 5555


def test_the_environment_overrides_the_config_file(tmp_path: Path, home: Path) -> None:
    # Given a config file and an E31_API_PORT variable that disagree
    config = write_config(tmp_path, "[api]\napi_port = 9000\napi_host = \"10.0.0.1\"\n")
    env = {"E31_HOME": str(home), "E31_CONFIG": str(config), "E31_API_PORT": "9100"}

    # When settings are loaded
    s = Settings.load(environ=env)

    # Then the variable wins (converted to its type) and the file still sets the rest
    assert s.api_port == 9100
    assert s.api_host == "10.0.0.1"


def test_overrides_win_over_the_environment_and_the_file(tmp_path: Path, home: Path) -> None:
    # Given a file, a variable and a flag that all set the API port
    config = write_config(tmp_path, "[api]\napi_port = 9000\n")
    env = {"E31_HOME": str(home), "E31_CONFIG": str(config), "E31_API_PORT": "9100"}

    # When settings are loaded with the flag as an override
    s = Settings.load({"api_port": 9200}, environ=env)

    # Then the flag wins
    assert s.api_port == 9200


def test_an_override_of_none_means_the_flag_was_not_given(home: Path) -> None:
    # Given a variable and an unset flag (None)
    env = {"E31_HOME": str(home), "E31_API_PORT": "9100"}

    # When settings are loaded
    s = Settings.load({"api_port": None}, environ=env)

    # Then the variable still applies
    assert s.api_port == 9100


def test_e31_home_sets_home_and_an_override_expands_a_tilde(home: Path) -> None:
    # Given E31_HOME in the environment
    # When settings are loaded, with and without a home override
    from_env = Settings.load(environ={"E31_HOME": str(home)})
    from_flag = Settings.load({"home": "~/elsewhere"}, environ={"E31_HOME": str(home)})

    # Then home comes from the variable, and the flag's tilde is expanded
    assert from_env.home == home
    assert from_flag.home == Path("~/elsewhere").expanduser()
    assert "~" not in str(from_flag.home)


def test_a_config_file_in_home_is_read_without_e31_config(home: Path) -> None:
    # Given an e31.toml in E31_HOME and no E31_CONFIG
    (home / "e31.toml").write_text("[flower]\nflower_port = 5600\n")

    # When settings are loaded
    s = Settings.load(environ={"E31_HOME": str(home)})

    # Then the home's file is used
    assert s.flower_port == 5600


def test_size_classes_from_the_config_file_replace_the_defaults(tmp_path: Path, home: Path) -> None:
    # Given a config file with two size classes listed biggest first
    config = write_config(tmp_path, '[[size_classes]]\nname = "big"\ngpu_mem_gb = 96\n'
                                    '[[size_classes]]\nname = "small"\ngpu_mem_gb = 16\n')

    # When settings are loaded
    s = Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(config)})

    # Then exactly those classes are used, smallest first
    assert [(c.name, c.gpu_mem_gb) for c in s.size_classes] == [("small", 16), ("big", 96)]


def test_an_invalid_environment_value_is_a_config_error_naming_the_variable(home: Path) -> None:
    # Given a port that is not a number
    env = {"E31_HOME": str(home), "E31_API_PORT": "eighty"}

    # When settings are loaded
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ=env)

    # Then the error names the setting and its variable
    assert "api_port" in caught.value.message
    assert "E31_API_PORT" in caught.value.message


def test_an_out_of_range_value_is_a_config_error_naming_the_variable(home: Path) -> None:
    # Given a scheduler tick of zero
    env = {"E31_HOME": str(home), "E31_SCHEDULER_TICK_S": "0"}

    # When settings are loaded
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ=env)

    # Then the error names E31_SCHEDULER_TICK_S
    assert "E31_SCHEDULER_TICK_S" in caught.value.message


def test_an_unknown_key_in_the_config_file_is_a_config_error(tmp_path: Path, home: Path) -> None:
    # Given a config file with a misspelt setting
    config = write_config(tmp_path, "[api]\napi_prot = 9000\n")

    # When settings are loaded
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(config)})

    # Then the error names it
    assert "api_prot" in caught.value.message


def test_duplicate_size_class_names_are_a_config_error(tmp_path: Path, home: Path) -> None:
    # Given two classes with one name
    config = write_config(tmp_path, '[[size_classes]]\nname = "g"\ngpu_mem_gb = 24\n'
                                    '[[size_classes]]\nname = "g"\ngpu_mem_gb = 48\n')

    # When settings are loaded
    # Then it is refused
    with pytest.raises(ConfigError, match="unique"):
        Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(config)})


def test_a_config_file_that_is_not_toml_is_a_config_error_naming_it(
        tmp_path: Path, home: Path) -> None:
    # Given a config file with a syntax error
    config = write_config(tmp_path, "[api\napi_port = 9000\n")

    # When settings are loaded
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(config)})

    # Then the error names the file
    assert str(config) in caught.value.message


def test_e31_config_pointing_at_no_file_is_a_config_error_naming_it(
        tmp_path: Path, home: Path) -> None:
    # Given E31_CONFIG naming a file that does not exist
    missing = tmp_path / "nope.toml"

    # When settings are loaded
    with pytest.raises(ConfigError) as caught:
        Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(missing)})

    # Then the error names E31_CONFIG and the path
    assert "E31_CONFIG" in caught.value.message
    assert str(missing) in caught.value.message


def test_the_repository_config_file_equals_the_built_in_defaults(home: Path) -> None:
    # Given the shipped config/e31.toml
    assert REPO_CONFIG.is_file(), REPO_CONFIG

    # When settings are loaded from it alone
    s = Settings.load(environ={"E31_HOME": str(home), "E31_CONFIG": str(REPO_CONFIG)})

    # Then they are exactly the built-in defaults (home aside)
    assert s.model_dump(exclude={"home"}) == Settings().model_dump(exclude={"home"})


def test_derived_urls_default_under_home(home: Path) -> None:
    # Given settings with no store or artifacts URL
    s = Settings.load(environ={"E31_HOME": str(home)})

    # Then the store is SQLite and the artifacts are files, both under home
    assert s.resolved_database_url == f"sqlite:///{home / 'e31.db'}"
    assert s.resolved_artifacts_url == f"file://{home / 'artifacts'}"
    assert s.resolved_work_dir == home / "work"


def test_a_postgresql_url_gets_the_psycopg_driver(home: Path) -> None:
    # Given a plain postgresql:// URL
    s = Settings.load(environ={"E31_HOME": str(home), "E31_DATABASE_URL": "postgres://u@db/e31"})

    # Then SQLAlchemy is told to use psycopg 3
    assert s.resolved_database_url == "postgresql+psycopg://u@db/e31"
