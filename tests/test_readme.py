"""The README's Python examples run as written (paths redirected to a temporary directory)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(tmp_path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 3
    code = "\n".join(blocks).replace('"/tmp/', f'"{tmp_path}/')
    namespace: dict = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), namespace)  # noqa: S102
    assert (tmp_path / "run" / "29" / "default" / "manifest.msgpack").exists()
    assert (tmp_path / "run2" / "0" / "state" / "manifest.msgpack").exists()
    assert (tmp_path / "run3" / "0" / "default" / "manifest.msgpack").exists()
