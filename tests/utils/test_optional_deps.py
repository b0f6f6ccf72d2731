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


def test_the_packages_of_switched_on_features_are_found_before_anything_is_built(monkeypatch, tmp_path):
    """Issue 31: a missing tensorboard failed on rank 0 after the model was built, and rank 1, left waiting in a
    collective, reported 'rank 1 lost another rank'. deepy.py checks its own environment (tests/e2e/test_prelaunch.py);
    each training worker checks its own (another node's may differ) before it starts anything."""
    import megatron.training.loop as loop
    import megatron.utils.optional_deps as optional_deps
    from tests.neox_arguments.helpers import tiny

    monkeypatch.setattr(optional_deps, "installed", lambda package: package not in ("tensorboard", "tiktoken"))
    monkeypatch.setattr(loop, "initialize_megatron", lambda args: pytest.fail("the worker started"))
    args = tiny(train_iters=2, optimizer={"type": "Adam", "params": {"lr": 1e-3}}, data_path=str(tmp_path / "d"),
                tensorboard_dir=str(tmp_path / "tb"), tensorboard={"enabled": True}, use_wandb=True,
                tokenizer_type="TiktokenTokenizer")
    with pytest.raises(MissingOptionalDependency) as err:
        loop.pretrain(args)
    assert str(err.value) == (
        f"tensorboard_dir={str(tmp_path / 'tb')!r} and the DeepSpeed section tensorboard: {{enabled: true}} need the "
        f"Python package 'tensorboard', which is not installed: pip install -r "
        f"requirements/requirements-tensorboard.txt "
        f"(or turn them off); tokenizer_type=TiktokenTokenizer needs the Python package 'tiktoken', which is not "
        f"installed: pip install -r requirements/requirements-tiktoken.txt (or turn it off)")
    assert optional_deps.missing_feature_packages(args, "generate.py") == [str(err.value).split("; ")[1]]
