import pytest

from fedhier.config import RunConfig
from fedhier.errors import ConfigError


def test_defaults_are_the_issue_default_run():
    c = RunConfig()
    assert (c.dataset, c.partition, c.alpha, c.clients, c.groups, c.grouping,
            c.local_period, c.global_period) == ("digits", "dirichlet", 0.5, 20, 4, "random", 5, 20)
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
