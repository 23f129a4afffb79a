from pathlib import Path

import pytest

from fedhier.common.errors import ConfigError
from fedhier.settings.run_config import RunConfig


def test_defaults_are_the_issue_default_run():
    c = RunConfig()
    assert (c.dataset, c.partition, c.alpha, c.clients, c.groups, c.grouping,
            c.local_period, c.global_period) == ("digits", "dirichlet", 0.5, 20, (4,), "random",
                                                 5, 20)
    assert c.periods == (5, 20)
    assert c.iterations == c.rounds * 20


def test_kebab_and_snake_keys_round_trip():
    c = RunConfig.from_mapping({"local-period": 2, "global_period": 6, "alpha": 1})
    assert c.local_period == 2 and c.global_period == 6 and c.alpha == 1.0
    assert RunConfig.from_mapping(c.to_run_config()) == c


@pytest.mark.parametrize("values,message", [
    ({"global_period": 7}, "multiple of local_period"),
    ({"alpha": 0}, "alpha must be > 0"),
    ({"groups": 30}, "more groups"),
    ({"model": "resnet"}, "unknown model"),
    ({"weighting": "sample"}, "did you mean 'samples'"),
    ({"lokal_period": 3}, "did you mean 'local_period'"),
    ({"clients": "ten"}, "must be an integer"),
    ({"lr": True}, "must be a number"),
    ({"batch_size": -1}, "batch_size"),
])
def test_bad_values_give_one_line_errors(values, message):
    with pytest.raises(ConfigError, match=message) as info:
        RunConfig.from_mapping(values)
    assert "\n" not in str(info.value)


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('dataset = "digits"\nlocal-period = 4\nglobal_period = 8\nseed = 3\n')
    c = RunConfig.from_toml(path)
    assert (c.local_period, c.global_period, c.seed) == (4, 8, 3)
    path.write_text("local_period = \n")
    with pytest.raises(ConfigError, match="malformed TOML"):
        RunConfig.from_toml(path)


def test_multi_level_groups_and_periods():
    c = RunConfig.from_mapping({"clients": 40, "groups": "8,2", "periods": [5, 20, 60]})
    assert c.groups == (8, 2) and (c.local_period, c.global_period) == (5, 60)
    assert c.to_run_config()["groups"] == "8,2"
    assert RunConfig.from_mapping(c.to_run_config()) == c
    with pytest.raises(ConfigError, match="need 3 periods"):
        RunConfig.from_mapping({"groups": "8,2"})
    with pytest.raises(ConfigError, match="more groups"):
        RunConfig.from_mapping({"groups": "2,8", "periods": "1,2,4"})
    with pytest.raises(ConfigError, match="contradicts"):
        RunConfig.from_mapping({"periods": "5,20", "local_period": 4})
    with pytest.raises(ConfigError, match="multiple"):
        RunConfig.from_mapping({"groups": "4,2", "periods": "5,20,30"})


def test_flower_app_config_declares_every_run_setting():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                              .read_text())
    declared = pyproject["tool"]["flwr"]["app"]["config"]
    assert set(declared) == set(RunConfig().to_run_config())
    RunConfig.from_mapping(declared, where="pyproject.toml")  # and the values are valid


@pytest.mark.parametrize("value", [2.5, float("inf"), float("nan"), [4, 1.5]])
def test_group_counts_must_be_whole_numbers(value):
    """int() would silently truncate 2.5 to 2 and raise OverflowError on inf."""
    with pytest.raises(ConfigError, match="must be integers"):
        RunConfig.from_mapping({"groups": value})


def test_flwr_run_config_at_the_defaults_lets_the_dataset_card_apply():
    """pyproject.toml lists every key for `flwr run`; values left at the field defaults
    count as not set, so `--run-config dataset='shakespeare'` picks the card's LSTM."""
    import tomllib

    table = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    shakespeare = RunConfig.from_app_config({**table, "dataset": "shakespeare"})
    assert shakespeare.model == "lstm" and shakespeare.partition == "natural"
    assert shakespeare.rounds == table["rounds"]  # a value the app set is kept
    chosen = RunConfig.from_app_config({**table, "dataset": "shakespeare", "clients": 12})
    assert chosen.clients == 12
    assert RunConfig.from_app_config(table) == RunConfig.from_mapping(
        {"rounds": table["rounds"]})


@pytest.mark.parametrize("values,message", [
    ({"seed": -1}, "seed must be in"), ({"seed": 2**32}, "seed must be in"),
    ({"lr": float("nan")}, "finite float32"), ({"alpha": 1e39}, "finite float32"),
    ({"rounds": 2**62}, "too large")])
def test_range_limits_hold_for_every_way_in(values, message):
    """The libraries' limits are RunConfig's own checks, so a `flwr run` run_config or a
    TOML file meets them as the command line does."""
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_app_config(values)
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_mapping(values)


def test_unparsable_edge_periods_do_not_skip_the_other_checks():
    """Found by the long fuzz profile: `--edge-periods x` once skipped validate() entirely,
    so `--client-holdout inf` reached the data layer (internal error)."""
    with pytest.raises(ConfigError, match="client_holdout"):
        RunConfig.from_mapping({"edge_periods": "x", "client_holdout": float("inf")})
    with pytest.raises(ConfigError, match="edge_periods"):
        RunConfig.from_mapping({"edge_periods": "x"})
