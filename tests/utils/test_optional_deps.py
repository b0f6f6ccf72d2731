import pytest

from megatron.utils.optional_deps import MissingOptionalDependency, require


def test_installed_module_is_returned():
    assert require("json", "some_flag", "dev").dumps([]) == "[]"


def test_missing_module_names_the_flag_and_requirements_file():
    with pytest.raises(MissingOptionalDependency) as err:
        require("surely_not_installed_pkg.sub", "use_wandb", "wandb")
    text = str(err.value)
    assert "use_wandb" in text and "surely_not_installed_pkg" in text
    assert "requirements/requirements-wandb.txt" in text
